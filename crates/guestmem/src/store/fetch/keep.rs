//! Keeping fetched frames in the cache, off the path to their readers: a frame goes to its
//! readers first, then to the cache on the runtime's blocking threads (one per CPU, at a
//! nice value below prefetch), its flight kept until then so a look meanwhile joins it.
//! Read-ahead's frames waiting to be kept are bounded ([`KEEP_PENDING_KIB`]); every frame
//! waiting is counted ([`Unkept`]) for `Frames::settle` and a `Frames` dropped.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Flights, FrameCache};

thread_local!(static NICED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });

/// Nice value of a cache write: below prefetch (nice 5), which installs what a VM will read;
/// a write only saves a later VM a GET.
pub(super) const KEEP_NICE: libc::c_int = 10;

/// How long a `Frames` dropped waits for its frames to be kept.
pub(super) const SETTLE_ON_DROP: Duration = Duration::from_secs(10);

/// Frames fetched by read-ahead that may wait to be kept at once, KiB (64 MiB).
pub(super) const KEEP_PENDING_KIB: u32 = 64 << 10;

/// The share of [`KEEP_PENDING_KIB`] a frame of `len` bytes takes.
pub(super) fn pending_kib(len: usize) -> u32 {
    (len.div_ceil(1024) as u64).clamp(1, KEEP_PENDING_KIB as u64) as u32
}

/// A fetched frame to keep in the cache, then end its flight. It holds nothing of its
/// `Frames` but the flight map: a write still waiting never keeps the client (and its
/// runtime) alive, and when the client goes, the writes under way finish and the others are
/// dropped (the frame is fetched again if needed).
pub(super) struct Keep {
    pub(super) cache: Arc<FrameCache>,
    pub(super) kept_as: blake3::Hash,
    pub(super) bytes: Arc<Vec<u8>>,
    pub(super) flight: blake3::Hash,
    pub(super) flights: Arc<Flights>,
    pub(super) writers: Arc<tokio::sync::Semaphore>,
    pub(super) _counted: Unkept,
}

/// How many fetched frames wait to be kept, for [`Frames::settle`].
#[derive(Debug, Default)]
pub(super) struct Unkept {
    count: Arc<(Mutex<usize>, std::sync::Condvar)>,
    /// One frame's share (made by `one`), not the count itself.
    counted: bool,
}

impl Unkept {
    /// One more; counted down when it is dropped (kept, given up, or dropped with the
    /// runtime).
    pub(super) fn one(&self) -> Unkept {
        *self.count.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Unkept {
            count: Arc::clone(&self.count),
            counted: true,
        }
    }

    /// Waits until none is left, or `limit` (if any) has passed.
    pub(super) fn wait(&self, limit: Option<Duration>) {
        let (n, cv) = &*self.count;
        let n = n.lock().unwrap_or_else(|e| e.into_inner());
        match limit {
            None => drop(cv.wait_while(n, |n| *n > 0)),
            Some(l) => drop(cv.wait_timeout_while(n, l, |n| *n > 0)),
        }
    }
}

impl Drop for Unkept {
    fn drop(&mut self) {
        if self.counted {
            let (n, cv) = &*self.count;
            let mut n = n.lock().unwrap_or_else(|e| e.into_inner());
            *n = n.saturating_sub(1);
            if *n == 0 {
                cv.notify_all();
            }
        }
    }
}

impl Keep {
    /// The write (a file made and written: 1.2 ms a frame on this project's journal-less
    /// ext4, where making a file scans for inodes not recently freed) runs on the runtime's
    /// blocking threads, one per CPU at [`KEEP_NICE`], never on its workers: a worker blocked
    /// in it held up the answers to every GET behind it, a fault's own among them
    /// (demand-miss p99 50-67 ms in the lab, with 64 read-ahead GETs landing at once).
    pub(super) async fn run(self) {
        let Keep {
            cache,
            kept_as,
            bytes,
            flight,
            flights,
            writers,
            _counted,
        } = self;
        if let Ok(_turn) = writers.acquire().await {
            let _ = tokio::task::spawn_blocking(move || {
                // Background work: below the faults a CPU is serving, and the prefetch.
                if !NICED.with(|n| n.replace(true)) {
                    crate::sys::set_thread_nice(KEEP_NICE);
                }
                cache.put(&kept_as, &bytes)
            })
            .await;
        }
        landed(&flights, &flight);
    }
}

/// Ends the flight of `hash`.
pub(super) fn landed(flights: &Flights, hash: &blake3::Hash) {
    flights
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(hash.as_bytes());
}
