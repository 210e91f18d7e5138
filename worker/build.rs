//! The migrations are embedded by `sqlx::migrate!`, which cargo cannot see read the folder: a
//! migration added or edited would otherwise leave a warm build with the old set.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
