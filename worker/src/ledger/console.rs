//! The console's spent ids (`console_spent_ids`): sign-in forms already submitted and sessions
//! signed out. Spending is one insert that the primary key decides, so of two submissions of
//! one form, on one worker or two, exactly one wins; a spent id is kept until it would have
//! expired anyway. Ids are stored as their SHA-256, never in clear.

use chrono::{DateTime, Utc};

use super::{Ledger, LedgerError};

/// What a spent id was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpentKind {
    /// A sign-in form's nonce, once submitted.
    LoginForm,
    /// A session id, once signed out.
    Session,
}

impl SpentKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SpentKind::LoginForm => "login_form",
            SpentKind::Session => "session",
        }
    }
}

fn digest(id: &str) -> String {
    crate::amqp::hex(&kit::secret::digest(id.as_bytes()))
}

impl Ledger {
    /// Spends `id` until `expires_at`: true when this call spent it, false when it was spent
    /// before.
    pub async fn spend_console_id(
        &self,
        kind: SpentKind,
        id: &str,
        expires_at: DateTime<Utc>,
    ) -> Result<bool, LedgerError> {
        let spent = sqlx::query(
            "INSERT INTO console_spent_ids (id, kind, expires_at) VALUES ($1, $2, $3)
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(digest(id))
        .bind(kind.as_str())
        .bind(expires_at)
        .execute(&self.pool)
        .await?;
        Ok(spent.rows_affected() == 1)
    }

    /// Whether `id` was spent.
    pub async fn console_id_spent(&self, id: &str) -> Result<bool, LedgerError> {
        let found: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM console_spent_ids WHERE id = $1")
                .bind(digest(id))
                .fetch_optional(&self.pool)
                .await?;
        Ok(found.is_some())
    }

    /// Deletes up to `batch` spent ids past their expiry; how many went.
    pub async fn delete_expired_console_ids(&self, batch: i64) -> Result<u64, LedgerError> {
        let done = sqlx::query(
            "DELETE FROM console_spent_ids WHERE id IN (
                 SELECT id FROM console_spent_ids WHERE expires_at < now() LIMIT $1)",
        )
        .bind(batch)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }
}
