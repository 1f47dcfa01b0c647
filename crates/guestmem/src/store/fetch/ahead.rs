//! Read-ahead: frames fetched in the background, in the order asked, a bounded number at
//! once, below the faults' own GETs ([`Frames::ahead`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Frames, Later, AHEAD_DEFER_MAX};
use crate::snapshot::Ahead;

impl Frames {
    /// Fetches `frames` (hash, plain length) in the background, in their order, a bounded
    /// number at once; those cached or in flight already are left. Returns at once.
    ///
    /// Turns are taken in the order asked, by one task a call: a VM's working set is asked
    /// for at once in the order the VM read it, and is read in that order again. With a
    /// task a frame, the runtime's two workers took turns out of order, the VM came to a
    /// frame no GET had started for, and its fault's own GET held all read-ahead back until
    /// it was installed (traced in the lab, a 1 GiB VM's working set cold at 20 ms: one or
    /// two such faults a round, each leaving the store idle for 20-40 ms). (GETs whose turns
    /// come together may still go out in another order: the runtime runs what it spawned
    /// last first.)
    ///
    /// `why`: a working set asked from the store ([`Ahead::Wanted`]) does not hold back for
    /// faults' own GETs (any VM's: a fault on it is most often its VM come to where its
    /// GETs have not reached yet). A guess does, and so does anything asked of a move's
    /// source (whose link the moved VM's faults need: without a cache, a move's owed frames
    /// are its working set): at most [`AHEAD_DEFER_MAX`] a call, not a frame.
    ///
    /// `alive`: what asks for them, where it may go first (a VM's image): once it is gone,
    /// no more of them is fetched.
    pub(crate) fn ahead(
        self: &Arc<Self>,
        frames: &[(blake3::Hash, usize)],
        why: Ahead,
        alive: Option<std::sync::Weak<()>>,
    ) {
        let (mut store, mut source) = (Vec::new(), Vec::new());
        for &(asked, len) in frames {
            let hash = match self.later_of(&asked) {
                None | Some(Later::Pending) => asked,
                Some(Later::Zero) => continue,
                Some(Later::Named(h)) => h,
                Some(Later::Served(h)) if self.cache.as_ref().is_some_and(|c| c.contains(&h)) => {
                    continue
                }
                Some(Later::Served(_)) => asked,
            };
            if self.cache.as_ref().is_some_and(|c| c.contains(&hash))
                || self
                    .flights
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains_key(hash.as_bytes())
            {
                continue;
            }
            match self.holder(&asked).is_some() || self.holder(&hash).is_some() {
                true => source.push((hash, len)),
                false => store.push((hash, len)),
            }
        }
        let store_gate = match why {
            Ahead::Wanted => &self.ahead,
            Ahead::Guessed => &self.guess,
        };
        // A guess's GETs to the store are paced too (`AheadGate::paced_turn`); a working set
        // is wanted at once, and a move's source is near.
        let guess = why == Ahead::Guessed;
        for (list, gate, yields, paced) in [
            (store, store_gate, guess, guess),
            (source, &self.peer_ahead, true, false),
        ] {
            if list.is_empty() {
                continue;
            }
            let (me, gate, alive) = (Arc::clone(self), Arc::clone(gate), alive.clone());
            let gone = move || alive.as_ref().is_some_and(|a| a.strong_count() == 0);
            self.client.handle().spawn(async move {
                // Never held back for long: a fault retrying toward a store (or a move's
                // source) that went away must not stop every VM's read-ahead. One deadline
                // for the call, from its first wait.
                let mut defer_until = None;
                for (hash, len) in list {
                    let turn = match paced {
                        true => gate.paced_turn().await,
                        false => gate.turn().await,
                    };
                    let Some(turn) = turn else {
                        return;
                    };
                    if gone() {
                        return;
                    }
                    if yields {
                        let until = *defer_until
                            .get_or_insert_with(|| tokio::time::Instant::now() + AHEAD_DEFER_MAX);
                        let _ = tokio::time::timeout_at(until, me.faults.after()).await;
                    }
                    // A fault may have fetched it while this waited for its turn.
                    if me
                        .cache
                        .as_ref()
                        .is_some_and(|c| c.contains(&me.kept_as(&hash)))
                    {
                        continue;
                    }
                    let tx = {
                        let mut f = me.flights.lock().unwrap_or_else(|e| e.into_inner());
                        if f.contains_key(hash.as_bytes()) {
                            continue;
                        }
                        let (tx, rx) = tokio::sync::watch::channel(None);
                        f.insert(*hash.as_bytes(), rx);
                        tx
                    };
                    me.counters.ahead.fetch_add(1, Ordering::Relaxed);
                    let me = Arc::clone(&me);
                    tokio::spawn(async move {
                        let _turn = turn;
                        let _ = me
                            .lead(hash, len, tx, true, std::time::Instant::now())
                            .await;
                    });
                }
            });
        }
    }
}
