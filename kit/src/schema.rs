//! What the worker and the publisher take from sqlx's macros, written out: migrations embedded
//! in the binary ([`embed_migrations!`](crate::embed_migrations), [`migrator`]) and structs read
//! from a row by column name ([`pg_row!`](crate::pg_row)). sqlx's macro feature compiles its
//! Postgres driver, TLS and runtime a second time, for the compiler, on the path of every clean
//! build; these do the same work with what the build already has.
//!
//! A migration embedded here is the one `sqlx::migrate!` embedded for the same file: the same
//! version and description (parsed from the file name the same way) and the same checksum (of
//! the same text), so a database migrated by an earlier build runs on unchanged.

use std::collections::BTreeSet;
use std::path::Path;

use sqlx::migrate::{Migration, MigrationType, Migrator};

/// A migrator for `files`: each a file name (`<version>_<description>.sql`) with its text.
///
/// # Panics
/// On a name without a numeric version, or a reversible (`.up.sql`, `.down.sql`) migration:
/// the list is fixed at compile time, and a test of each list runs this.
pub fn migrator(files: &[(&'static str, &'static str)]) -> Migrator {
    let migrations = files
        .iter()
        .map(|&(name, sql)| {
            let (version, rest) = parse_name(name).unwrap_or_else(|| {
                panic!("migration {name}: not `<numeric version>_<description>.sql`")
            });
            assert_eq!(
                MigrationType::from_filename(rest),
                MigrationType::Simple,
                "migration {name}: only simple migrations are embedded"
            );
            let description = rest.trim_end_matches(".sql").replace('_', " ");
            Migration::new(
                version,
                description.into(),
                MigrationType::Simple,
                sqlx::SqlStr::from_static(sql),
                sql.starts_with("-- no-transaction"),
            )
        })
        .collect();
    Migrator::with_migrations(migrations)
}

/// The `.sql` files of `dir` that `migrator` does not hold (by version): for a test that keeps
/// an embedded list complete.
pub fn unlisted(dir: &Path, migrator: &Migrator) -> std::io::Result<Vec<String>> {
    let listed: BTreeSet<i64> = migrator.iter().map(|m| m.version).collect();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if parse_name(&name).is_some_and(|(v, _)| !listed.contains(&v)) {
            missing.push(name);
        }
    }
    missing.sort();
    Ok(missing)
}

/// A migration file's version and the rest of its name (`<description>.sql`, or `.up.sql` /
/// `.down.sql`), as sqlx reads a migrations folder: None for any other file.
fn parse_name(name: &str) -> Option<(i64, &str)> {
    let (version, rest) = name.split_once('_')?;
    rest.ends_with(".sql")
        .then(|| version.parse().ok().map(|v| (v, rest)))
        .flatten()
}

/// A [`Migrator`] holding the named files of `dir` (relative to the calling crate's manifest),
/// embedded in the binary: `kit::embed_migrations!("../migrations": "0001_ledger.sql", ...)`.
#[macro_export]
macro_rules! embed_migrations {
    ($dir:literal : $($file:literal),+ $(,)?) => {
        $crate::schema::migrator(&[$((
            $file,
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/", $dir, "/", $file)),
        )),+])
    };
}

/// Declares a struct and reads it from a Postgres row, each field from the column of its name,
/// as `#[derive(sqlx::FromRow)]` does (no renames, no flattening: write those by hand).
#[macro_export]
macro_rules! pg_row {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $($(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty),* $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $($(#[$fmeta])* $fvis $field: $ty),*
        }

        impl<'r> ::sqlx::FromRow<'r, ::sqlx::postgres::PgRow> for $name {
            fn from_row(
                row: &'r ::sqlx::postgres::PgRow,
            ) -> ::std::result::Result<Self, ::sqlx::Error> {
                use ::sqlx::Row as _;
                ::std::result::Result::Ok($name {
                    $($field: row.try_get(stringify!($field))?),*
                })
            }
        }
    };
}
