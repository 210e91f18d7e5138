//! Comparing secrets (bearer tokens) without telling an attacker, through the answer time, how
//! much of a guess was right or how long the real token is; and the message authentication
//! code (HMAC-SHA256) the console's cookies and the signed callbacks use.

use sha2::{Digest, Sha256};

/// Equality of two secrets in time independent of where they differ and of their lengths:
/// both are hashed (SHA-256) first and the two digests compared in full, so there is no early
/// return on a length mismatch or on the first differing byte.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    digests_eq(&Sha256::digest(a).into(), &Sha256::digest(b).into())
}

/// The SHA-256 digest of a secret, for keeping a token as a digest rather than in clear.
pub fn digest(secret: &[u8]) -> [u8; 32] {
    Sha256::digest(secret).into()
}

/// Equality of two digests, every byte compared.
pub fn digests_eq(x: &[u8; 32], y: &[u8; 32]) -> bool {
    let diff = x
        .iter()
        .zip(y.iter())
        .fold(0u8, |acc, (p, q)| acc | (p ^ q));
    // Keeps the compiler from turning the fold into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

/// HMAC-SHA256 (RFC 2104).
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut block = [0u8; BLOCK];
    if key.len() > BLOCK {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.map(|b| b ^ byte);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_secrets_are_compared_whatever_their_lengths() {
        assert!(constant_time_eq(
            b"s3cret-admin-token",
            b"s3cret-admin-token"
        ));
        assert!(!constant_time_eq(
            b"s3cret-admin-token",
            b"s3cret-admin-tokeN"
        ));
        assert!(!constant_time_eq(b"s3cret-admin-token", b"s3cret"));
        assert!(!constant_time_eq(b"s3cret", b"s3cret-admin-token"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
        assert!(digests_eq(&digest(b"abc"), &digest(b"abc")));
        assert!(!digests_eq(&digest(b"abc"), &digest(b"abd")));
    }
}
