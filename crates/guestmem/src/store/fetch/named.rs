//! The pieces of a move's diff named later (`store::later`): each under a placeholder, fetched
//! from the move's source with the hash of its bytes, kept in the cache under that hash, until
//! the store's manifest names it. What a `Frames` knows of each, and the checks that the
//! bytes a VM was served are the bytes the store names.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use super::Frames;

/// What is known of a piece of a move's diff named later (under a placeholder,
/// `store::later`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Later {
    /// Nothing yet: fetched from the source under its placeholder.
    Pending,
    /// The source served it, saying (and the bytes checked against) the hash of its bytes:
    /// kept in the cache under that hash; fetched again under the placeholder if not there.
    Served(blake3::Hash),
    /// The store's manifest names it: fetched as any frame.
    Named(blake3::Hash),
    /// The store's manifest holds it as a frame of zeros.
    Zero,
}

impl Frames {
    /// The pieces under `placeholders` are a move's diff's, named later: each is fetched
    /// from the source under its placeholder (which serves the hash of its bytes with
    /// them) until [`Frames::name_later_as`] gives the hashes the store names.
    pub(crate) fn name_later(&self, placeholders: impl IntoIterator<Item = blake3::Hash>) {
        let mut l = self.later.lock().unwrap_or_else(|e| e.into_inner());
        for p in placeholders {
            l.insert(*p.as_bytes(), Later::Pending);
        }
        self.any_later.store(!l.is_empty(), Ordering::Release);
    }

    /// The store's names of pieces named later: (placeholder, its hash, or `None` for a
    /// frame of zeros, its plain length). Refused, with nothing changed, where a piece the
    /// source served had other bytes than the store names: the VM has read them.
    pub(crate) fn name_later_as(
        &self,
        names: &[(blake3::Hash, Option<blake3::Hash>, usize)],
    ) -> Result<(), String> {
        let mut l = self.later.lock().unwrap_or_else(|e| e.into_inner());
        let mut seen = HashSet::new();
        for (p, h, len) in names {
            if !seen.insert(*p.as_bytes()) {
                return Err(format!("the placeholder {p} is named twice"));
            }
            let served = match l.get(p.as_bytes()) {
                Some(Later::Served(s)) => *s,
                Some(_) => continue,
                None => return Err(format!("{p} is not a placeholder of this move")),
            };
            let named = match h {
                Some(h) => *h,
                None => blake3::hash(&vec![0u8; *len]),
            };
            if served != named {
                return Err(format!(
                    "the source served the piece {p} as {served}, the store names {named}"
                ));
            }
        }
        for (p, h, _) in names {
            l.insert(*p.as_bytes(), h.map_or(Later::Zero, Later::Named));
        }
        Ok(())
    }

    /// The move whose pieces these are is over: their placeholders are forgotten.
    pub(crate) fn forget_later(&self, placeholders: impl IntoIterator<Item = blake3::Hash>) {
        let mut l = self.later.lock().unwrap_or_else(|e| e.into_inner());
        for p in placeholders {
            l.remove(p.as_bytes());
        }
        self.any_later.store(!l.is_empty(), Ordering::Release);
    }

    /// What is known of `hash` if it is a placeholder.
    pub(super) fn later_of(&self, hash: &blake3::Hash) -> Option<Later> {
        if !self.any_later.load(Ordering::Acquire) {
            return None;
        }
        let l = self.later.lock().unwrap_or_else(|e| e.into_inner());
        l.get(hash.as_bytes()).copied()
    }

    /// Whether a move's source host owes the piece of `hash` and this host does not hold it
    /// yet: a fault on it waits on the source.
    pub(crate) fn owed_here(&self, hash: &blake3::Hash) -> bool {
        let at = match self.later_of(hash) {
            Some(Later::Zero) => return false,
            Some(Later::Named(h)) => h,
            _ => *hash,
        };
        self.holder(&at).is_some() && !self.cached(hash)
    }

    /// Whether the piece of `hash` is read on this host without a request: zeros, or
    /// in the cache.
    pub(crate) fn held_here(&self, hash: &blake3::Hash) -> bool {
        matches!(self.later_of(hash), Some(Later::Zero)) || self.cached(hash)
    }

    /// Whether the cache holds the piece of `hash` (under the hash it is kept as).
    fn cached(&self, hash: &blake3::Hash) -> bool {
        self.cache
            .as_ref()
            .is_some_and(|c| c.contains(&self.kept_as(hash)))
    }

    /// The hash the frame asked for as `hash` is kept under in the cache: its own, or for a
    /// piece named later, the hash it was served or named as (while none is known, its
    /// placeholder, which nothing is kept under).
    pub(super) fn kept_as(&self, hash: &blake3::Hash) -> blake3::Hash {
        match self.later_of(hash) {
            Some(Later::Served(h) | Later::Named(h)) => h,
            _ => *hash,
        }
    }

    /// The source served the piece of placeholder `p` as `hash`; refused where it was
    /// served or named otherwise before.
    pub(super) fn served(
        &self,
        p: &blake3::Hash,
        hash: blake3::Hash,
        len: usize,
    ) -> Result<(), String> {
        let mut l = self.later.lock().unwrap_or_else(|e| e.into_inner());
        let before = l.get(p.as_bytes()).copied();
        let known = match before {
            None | Some(Later::Pending) => None,
            Some(Later::Served(h) | Later::Named(h)) => Some(h),
            Some(Later::Zero) => Some(blake3::hash(&vec![0u8; len])),
        };
        match known {
            Some(k) if k != hash => Err(format!(
                "the source served the piece {p} as {hash}, before as {k}"
            )),
            _ => {
                if matches!(before, Some(Later::Pending)) {
                    l.insert(*p.as_bytes(), Later::Served(hash));
                }
                Ok(())
            }
        }
    }
}
