//! What a region's memory has been through, held by the region for the modules that own it:
//! its restore state (moved only by [`crate::restore`], read by populate, bring-up and save)
//! and the save its dirty bits count from (kept by [`crate::snapshot`]). A leaf module, so
//! `region` depends on neither of them.
//!
//! The restore state is one atomic word behind an enum and named moves, so no module writes
//! raw constants into it.
//!
//! ```text
//!            begin              complete
//!   Whole ──────────▶ Restoring ──────────▶ Whole
//!     ▲ │               │    │
//!     │ └ populate ─┐   └── lose ──▶ Lost (for good)
//!     │             ▼
//!     └─ end ── Populating            (and abort: Restoring ──▶ Whole)
//! ```
//!
//! `begin` and `populate` are compare-and-swaps from `Whole`, so two restores cannot fill
//! one region at once, nor a restore begin while a populate runs on it (whose undo, after a
//! failed chunk, would discard restored data), nor two populates run on one region (one's
//! undo discarding the other's work). Bring-up reads the state and refuses a region that is
//! not `Whole`; save refuses one a restore is filling or lost (it could save memory that has
//! not arrived), and saves one being populated.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

/// What a region remembers for restores and snapshots.
#[derive(Debug, Default)]
pub(crate) struct Lifecycle {
    /// Whether a restore is filling it, or failed.
    pub(crate) restore: RestoreCell,
    /// The id of the save its dirty bitmap counts from (the last save of it). Held for the
    /// whole of a save, so two saves of one region run one after the other and each sees
    /// the id the other left: an incremental save checks its parent and takes the dirty set
    /// under this one lock.
    pub(crate) saved_as: Mutex<Option<String>>,
}

/// Where a region stands with respect to restores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum RestoreState {
    /// Its memory is whole: never restored, or restored completely.
    Whole,
    /// A restore is filling it.
    Restoring,
    /// A restore failed: part of it never arrived and is poisoned (reads raise `SIGBUS`).
    Lost,
    /// A populate is running on it (its memory is whole).
    Populating,
}

impl RestoreState {
    const fn word(self) -> u8 {
        match self {
            RestoreState::Whole => 0,
            RestoreState::Restoring => 1,
            RestoreState::Lost => 2,
            RestoreState::Populating => 3,
        }
    }

    fn from_word(w: u8) -> RestoreState {
        match w {
            0 => RestoreState::Whole,
            1 => RestoreState::Restoring,
            3 => RestoreState::Populating,
            _ => RestoreState::Lost,
        }
    }

    /// Why a region in this state cannot be populated or saved, or `None` when it can.
    pub(crate) fn refusal(self) -> Option<&'static str> {
        match self {
            RestoreState::Whole => None,
            RestoreState::Restoring => {
                Some("a restore is still filling it: wait for it (LazyRestore::finish) first")
            }
            RestoreState::Lost => Some("a restore failed and part of it is lost"),
            RestoreState::Populating => {
                Some("a populate is running on it: wait for it to return first")
            }
        }
    }
}

/// A region's restore state (see the module docs for the moves).
#[derive(Debug, Default)]
pub(crate) struct RestoreCell(AtomicU8);

impl RestoreCell {
    /// The state now.
    pub(crate) fn get(&self) -> RestoreState {
        RestoreState::from_word(self.0.load(Ordering::Acquire))
    }

    /// `from` to `to`; else the state that stood in the way.
    fn swap(&self, from: RestoreState, to: RestoreState) -> Result<(), RestoreState> {
        self.0
            .compare_exchange(from.word(), to.word(), Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(RestoreState::from_word)
    }

    /// `Whole` to `Restoring`; else the state that stood in the way.
    pub(crate) fn begin(&self) -> Result<(), RestoreState> {
        self.swap(RestoreState::Whole, RestoreState::Restoring)
    }

    fn leave_restoring(&self, to: RestoreState) {
        let _ = self.swap(RestoreState::Restoring, to);
    }

    /// `Whole` to `Populating`; else the state that stood in the way.
    pub(crate) fn populate(&self) -> Result<(), RestoreState> {
        self.swap(RestoreState::Whole, RestoreState::Populating)
    }

    /// `Populating` to `Whole`: the populate returned.
    pub(crate) fn end_populate(&self) {
        let _ = self.swap(RestoreState::Populating, RestoreState::Whole);
    }

    /// `Restoring` to `Whole`: every byte arrived.
    pub(crate) fn complete(&self) {
        self.leave_restoring(RestoreState::Whole);
    }

    /// `Restoring` to `Whole`: the restore was undone before it wrote anything the caller
    /// keeps (a start that failed).
    pub(crate) fn abort(&self) {
        self.leave_restoring(RestoreState::Whole);
    }

    /// `Restoring` to `Lost`: the restore failed.
    pub(crate) fn lose(&self) {
        self.leave_restoring(RestoreState::Lost);
    }
}

/// Regions moved from `Whole` to `Populating` together, or none; back to `Whole` when
/// dropped (a panic included).
pub(crate) struct PopulateClaim<'a>(Vec<&'a RestoreCell>);

impl<'a> PopulateClaim<'a> {
    /// Claims every cell; else, none, and the index of the first that could not be claimed
    /// with the state that stood in the way.
    pub(crate) fn take(
        cells: impl IntoIterator<Item = &'a RestoreCell>,
    ) -> Result<PopulateClaim<'a>, (usize, RestoreState)> {
        let mut claimed = PopulateClaim(Vec::new());
        for (i, c) in cells.into_iter().enumerate() {
            c.populate().map_err(|state| (i, state))?;
            claimed.0.push(c);
        }
        Ok(claimed)
    }
}

impl Drop for PopulateClaim<'_> {
    fn drop(&mut self) {
        self.0.iter().for_each(|c| c.end_populate());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_are_only_the_legal_ones() {
        let c = RestoreCell::default();
        assert_eq!(c.get(), RestoreState::Whole);
        c.begin().unwrap();
        assert_eq!(
            c.begin(),
            Err(RestoreState::Restoring),
            "one restore at a time"
        );
        c.complete();
        assert_eq!(c.get(), RestoreState::Whole);
        c.lose(); // not restoring: no move
        assert_eq!(c.get(), RestoreState::Whole);
        c.begin().unwrap();
        c.lose();
        assert_eq!(c.get(), RestoreState::Lost);
        assert_eq!(
            c.begin(),
            Err(RestoreState::Lost),
            "lost memory is not restored over"
        );
        c.complete();
        assert_eq!(c.get(), RestoreState::Lost, "lost is for good");
        assert!(RestoreState::Lost.refusal().is_some());
        assert!(RestoreState::Whole.refusal().is_none());

        // A populate holds a region off restores and other populates until it ends.
        let c = RestoreCell::default();
        c.populate().unwrap();
        assert_eq!(
            c.begin(),
            Err(RestoreState::Populating),
            "no restore while populating"
        );
        assert_eq!(
            c.populate(),
            Err(RestoreState::Populating),
            "one populate at a time"
        );
        assert!(RestoreState::Populating.refusal().is_some());
        c.end_populate();
        assert_eq!(c.get(), RestoreState::Whole);
        c.begin().unwrap();
        assert_eq!(
            c.populate(),
            Err(RestoreState::Restoring),
            "no populate while restoring"
        );
        c.end_populate(); // not populating: no move
        assert_eq!(c.get(), RestoreState::Restoring);

        // A claim takes every cell or none, and gives them back when dropped.
        let (a, b) = (RestoreCell::default(), RestoreCell::default());
        b.begin().unwrap();
        assert_eq!(
            PopulateClaim::take([&a, &b]).err(),
            Some((1, RestoreState::Restoring))
        );
        assert_eq!(a.get(), RestoreState::Whole, "none taken");
        b.complete();
        let claim = PopulateClaim::take([&a, &b]).unwrap();
        assert_eq!(
            (a.get(), b.get()),
            (RestoreState::Populating, RestoreState::Populating)
        );
        drop(claim);
        assert_eq!(
            (a.get(), b.get()),
            (RestoreState::Whole, RestoreState::Whole)
        );
    }
}
