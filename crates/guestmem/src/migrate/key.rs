//! A move's shared key: a secret both hosts hold (the same file on each, put there by the
//! operator), so that each side proves to the other that it is the host the operator meant.
//!
//! From it and a nonce each side draws at connect time comes the key of this connection
//! ([`SessionKey`]): every control message then carries a MAC (keyed BLAKE3) over its
//! direction, its place in the stream and its bytes, so that no message can be forged,
//! changed, reordered, replayed from another move, or reflected back; and the destination's
//! requests for the diff's frames carry a token drawn from it, without which the source's
//! page server answers none; the pieces it serves under placeholders carry a seal. What it
//! does not give: secrecy. The frames, the vmstate and the token cross the network as they
//! are, and someone on the path between the hosts can read them (and stop the move, which
//! then fails closed); a tunnel (WireGuard, `ssh -L`) or a private network gives that
//! (docs/move.md, "Security"). The key proves that a side holds it, not which host it is:
//! one key for every host lets any of them stand in for another.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use super::MoveError;

/// The fewest bytes a key file holds (a 256-bit secret, as `head -c 32 /dev/urandom`).
pub const MIN_KEY_BYTES: u64 = 32;
/// The most (a key file is a secret, not a document).
pub const MAX_KEY_BYTES: u64 = 4096;

/// The context a move key is derived in (BLAKE3's `derive_key`): a key file used for
/// something else too gives this use a key of its own.
const CONTEXT: &str = "guestmem 2026-11-27 move between hosts: shared key";

/// A move's shared key. Its `Debug` shows nothing of it.
#[derive(Clone)]
pub struct MoveKey([u8; 32]);

impl std::fmt::Debug for MoveKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MoveKey(..)")
    }
}

impl MoveKey {
    /// The key of `secret` (at least [`MIN_KEY_BYTES`] bytes, at most [`MAX_KEY_BYTES`]).
    pub fn from_secret(secret: &[u8]) -> Result<MoveKey, MoveError> {
        let n = secret.len() as u64;
        if !(MIN_KEY_BYTES..=MAX_KEY_BYTES).contains(&n) {
            return Err(MoveError::Key {
                path: "(given)".into(),
                reason: format!(
                    "{n} bytes; a move key is {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes"
                ),
            });
        }
        Ok(MoveKey(blake3::derive_key(CONTEXT, secret)))
    }

    /// The key in the file at `path`: a regular file (not followed through a symlink) that
    /// only its owner may read or write, of [`MIN_KEY_BYTES`] to [`MAX_KEY_BYTES`] bytes.
    pub fn from_file(path: &Path) -> Result<MoveKey, MoveError> {
        let bad = |reason: String| MoveError::Key {
            path: path.to_path_buf(),
            reason,
        };
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| bad(format!("open: {e}")))?;
        let meta = f.metadata().map_err(|e| bad(format!("stat: {e}")))?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        // SAFETY: geteuid takes nothing and cannot fail.
        let euid = unsafe { libc::geteuid() };
        if meta.uid() != euid {
            return Err(bad(format!(
                "owned by uid {}, not by this process's ({euid})",
                meta.uid()
            )));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(bad(format!(
                "mode {:o}: others than its owner may read or change it (chmod 600)",
                meta.mode() & 0o777
            )));
        }
        if !(MIN_KEY_BYTES..=MAX_KEY_BYTES).contains(&meta.len()) {
            return Err(bad(format!(
                "{} bytes; a move key is {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes (head -c 32 /dev/urandom > FILE)",
                meta.len()
            )));
        }
        let mut secret = Vec::with_capacity(meta.len() as usize);
        (&f).take(MAX_KEY_BYTES + 1)
            .read_to_end(&mut secret)
            .map_err(|e| bad(format!("read: {e}")))?;
        let key = MoveKey::from_secret(&secret).map_err(|_| {
            bad(format!(
                "{} bytes read; it changed while read",
                secret.len()
            ))
        });
        secret.fill(0);
        key
    }

    /// The key of one connection, from the source's nonce and the destination's.
    pub(crate) fn session(&self, source: &[u8; 32], destination: &[u8; 32]) -> SessionKey {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"session");
        h.update(source);
        h.update(destination);
        SessionKey(*h.finalize().as_bytes())
    }
}

/// Which way a message goes, in its MAC: a message cannot be sent back to its sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    /// Source to destination.
    ToDestination = 1,
    /// Destination to source.
    ToSource = 2,
}

/// The key of one move's connection (see the module docs).
#[derive(Clone)]
pub(crate) struct SessionKey([u8; 32]);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    /// The MAC of the `seq`-th message going `way`, `bytes` long.
    pub(crate) fn mac(&self, way: Way, seq: u64, bytes: &[u8]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"message");
        h.update(&[way as u8]);
        h.update(&seq.to_le_bytes());
        h.update(&(bytes.len() as u64).to_le_bytes());
        h.update(bytes);
        *h.finalize().as_bytes()
    }

    /// The key the source's page server seals the pieces named later with, and the
    /// destination checks them with ([`crate::store`]'s `seal`).
    pub(crate) fn piece_key(&self) -> [u8; 32] {
        *blake3::keyed_hash(&self.0, b"seal the diff's pieces").as_bytes()
    }

    /// The token the destination's requests for frames carry (hex), and the source's page
    /// server asks for.
    pub(crate) fn read_token(&self) -> String {
        blake3::keyed_hash(&self.0, b"read the diff's frames")
            .to_hex()
            .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_key_file_others_may_read_or_too_short_is_refused_naming_it() {
        let scratch = guestmem_testkit::Scratch::new("move-key");
        let p = scratch.join("key");
        std::fs::write(&p, [7u8; 32]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = MoveKey::from_file(&p).unwrap_err().to_string();
        assert!(
            e.contains(&p.display().to_string()) && e.contains("chmod 600"),
            "{e}"
        );
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let k = MoveKey::from_file(&p).unwrap();
        assert_eq!(format!("{k:?}"), "MoveKey(..)");
        std::fs::write(&p, [7u8; 31]).unwrap();
        let e = MoveKey::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("31 bytes"), "{e}");
        let link = scratch.join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(
            MoveKey::from_file(&link).is_err(),
            "a symlink is not followed"
        );
    }

    #[test]
    fn a_sessions_macs_differ_by_key_nonce_way_place_and_bytes() {
        let (a, b) = (
            MoveKey::from_secret(&[1u8; 32]).unwrap(),
            MoveKey::from_secret(&[2u8; 32]).unwrap(),
        );
        let (n1, n2) = ([3u8; 32], [4u8; 32]);
        let s = a.session(&n1, &n2);
        let m = s.mac(Way::ToDestination, 0, b"x");
        assert_eq!(m, a.session(&n1, &n2).mac(Way::ToDestination, 0, b"x"));
        for other in [
            b.session(&n1, &n2).mac(Way::ToDestination, 0, b"x"),
            a.session(&n2, &n1).mac(Way::ToDestination, 0, b"x"),
            s.mac(Way::ToSource, 0, b"x"),
            s.mac(Way::ToDestination, 1, b"x"),
            s.mac(Way::ToDestination, 0, b"y"),
        ] {
            assert_ne!(m, other);
        }
        assert_ne!(s.read_token(), b.session(&n1, &n2).read_token());
        assert!(crate::store::same_bytes(&m, &m) && !crate::store::same_bytes(&m, &other_than(m)));
    }

    fn other_than(mut m: [u8; 32]) -> [u8; 32] {
        m[31] ^= 1;
        m
    }
}
