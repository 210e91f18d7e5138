//! `sqlx::migrate!` embeds the migrations folder, but cargo does not know the macro reads it: a
//! migration added or edited would otherwise leave a warm build with the old set.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
