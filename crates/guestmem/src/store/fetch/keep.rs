//! Keeping fetched frames in the cache, off the path to their readers. A frame goes to its
//! readers first; then a thread of the [`Keeper`] writes it to the cache (appended to a
//! segment: 0.04 ms for 256 KiB here; when the cache made a file a frame, up to 1.2 ms on
//! this project's journal-less ext4), and only then does its flight end, so that a look
//! meanwhile joins the flight instead of fetching the frame again. Written on the runtime's
//! workers, before the readers were told, a write held up the answers to every GET behind it,
//! a fault's own among them (demand-miss p99 50-67 ms in the lab, with 64 read-ahead GETs
//! landing at once).
//!
//! Bounded: frames waiting to be written hold at most [`KEEP_PENDING_KIB`] between them,
//! twice over: once for background fetches (read-ahead, prefetch threads, a host warmed
//! ahead), which wait for room, so they go no faster than the disk takes their frames; once
//! for faults' frames, which never wait: with no room such a frame is served and not kept
//! (counted as uncached). Faults have room of their own because a frame a fault fetched and
//! did not keep is fetched again by the read-ahead that comes by later (measured: 1.07 GETs
//! a frame when faults shared read-ahead's room).

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Flights, FrameCache};

/// Nice value of the writer threads: below prefetch (nice 5), which installs what a VM will
/// read; a write only saves a later VM a GET.
const KEEP_NICE: libc::c_int = 10;

/// How long a `Frames` dropped waits for its frames to be kept.
pub(super) const SETTLE_ON_DROP: Duration = Duration::from_secs(10);

/// Frames that may wait to be written at once, KiB (64 MiB).
const KEEP_PENDING_KIB: u32 = 64 << 10;

/// A fetched frame to keep.
pub(super) struct Keep {
    pub(super) cache: Arc<FrameCache>,
    /// The hash to keep it under.
    pub(super) kept_as: blake3::Hash,
    pub(super) bytes: Arc<Vec<u8>>,
    /// The flights to end once it is kept (its own, and the one under `kept_as` if it
    /// opened that one too: a piece of a move's diff named later).
    pub(super) flights: Vec<blake3::Hash>,
}

/// A frame handed to a writer thread, with what it holds until written.
struct Job {
    keep: Keep,
    _room: tokio::sync::OwnedSemaphorePermit,
    _counted: Unkept,
}

/// The writer threads of one `Frames` (one per CPU, started on its first frame to keep), and
/// the room and count of the frames waiting for them.
#[derive(Debug)]
pub(super) struct Keeper {
    flights: Arc<Flights>,
    jobs: Mutex<Option<Sender<Job>>>,
    /// Background fetches' room, KiB.
    room: Arc<tokio::sync::Semaphore>,
    /// Faults' room, KiB.
    faults_room: Arc<tokio::sync::Semaphore>,
    unkept: Unkept,
}

impl Keeper {
    pub(super) fn new(flights: Arc<Flights>) -> Keeper {
        Keeper {
            flights,
            jobs: Mutex::new(None),
            room: Arc::new(tokio::sync::Semaphore::new(KEEP_PENDING_KIB as usize)),
            faults_room: Arc::new(tokio::sync::Semaphore::new(KEEP_PENDING_KIB as usize)),
            unkept: Unkept::default(),
        }
    }

    /// Hands `keep` to the writers. `wait`: a background fetch, which waits for room; a
    /// fault's frame does not: with no room it is not kept, and its flights end now.
    pub(super) async fn keep(&self, keep: Keep, wait: bool) {
        let kib = (keep.bytes.len().div_ceil(1024) as u64).clamp(1, KEEP_PENDING_KIB as u64);
        let room = match wait {
            true => Arc::clone(&self.room)
                .acquire_many_owned(kib as u32)
                .await
                .ok(),
            false => Arc::clone(&self.faults_room)
                .try_acquire_many_owned(kib as u32)
                .ok(),
        };
        let Some(room) = room else {
            keep.cache.skipped();
            self.landed(&keep.flights);
            return;
        };
        let job = Job {
            _counted: self.unkept.one(),
            keep,
            _room: room,
        };
        let (tx, flights) = (self.sender(), Arc::clone(&self.flights));
        let hand_over = move || {
            if let Err(job) = tx.send(job) {
                // No writer thread could be started: served, not kept.
                job.0.keep.cache.skipped();
                landed(&flights, &job.0.keep.flights);
            }
        };
        match wait {
            true => hand_over(),
            // A fault's frame: handed over once the faults read with it are installed,
            // for the send wakes a writer (`crate::batch`). Its flight stays open until
            // then, so a look meanwhile joins it and finds its bytes.
            false => crate::batch::later(hand_over),
        }
    }

    /// Ends the flights of `hashes`.
    pub(super) fn landed(&self, hashes: &[blake3::Hash]) {
        landed(&self.flights, hashes);
    }

    /// Waits until no frame waits to be written, or `limit` (if any) has passed. Frames
    /// handed over meanwhile are waited for too.
    pub(super) fn wait(&self, limit: Option<Duration>) {
        self.unkept.wait(limit);
    }

    /// The writers' queue, the threads started the first time.
    fn sender(&self) -> Sender<Job> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = jobs.as_ref() {
            return tx.clone();
        }
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut started = 0;
        for i in 0..crate::jobs::default_threads() {
            let (rx, flights) = (Arc::clone(&rx), Arc::clone(&self.flights));
            let spawned = std::thread::Builder::new()
                .name(format!("guestmem-keep{i}"))
                .stack_size(crate::jobs::WORKER_STACK_BYTES)
                .spawn(move || write_frames(&rx, &flights));
            started += usize::from(spawned.is_ok());
        }
        if started > 0 {
            *jobs = Some(tx.clone());
        }
        // With none started, `tx`'s receiver is gone and every send fails.
        tx
    }
}

/// A writer thread: writes the frames it is handed until its `Frames` goes (the queue's
/// sender dropped), then what is left in the queue.
fn write_frames(rx: &Mutex<Receiver<Job>>, flights: &Flights) {
    crate::sys::set_thread_nice(KEEP_NICE);
    loop {
        let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(job) = job else { return };
        let k = &job.keep;
        k.cache.put(&k.kept_as, &k.bytes);
        landed(flights, &k.flights);
    }
}

/// Ends the flights of `hashes`.
pub(super) fn landed(flights: &Flights, hashes: &[blake3::Hash]) {
    let mut f = flights.lock().unwrap_or_else(|e| e.into_inner());
    for h in hashes {
        f.remove(h.as_bytes());
    }
}

/// How many fetched frames wait to be kept.
#[derive(Debug, Default)]
struct Unkept {
    count: Arc<(Mutex<usize>, std::sync::Condvar)>,
    /// One frame's share (made by `one`), not the count itself.
    counted: bool,
}

impl Unkept {
    /// One more; counted down when it is dropped (written, or dropped unwritten).
    fn one(&self) -> Unkept {
        *self.count.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Unkept {
            count: Arc::clone(&self.count),
            counted: true,
        }
    }

    fn wait(&self, limit: Option<Duration>) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    /// A keep for a frame of `len` bytes, its flight registered.
    fn keep(cache: &Arc<FrameCache>, flights: &Flights, len: usize, seed: u8) -> Keep {
        let bytes: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(seed) | 1).collect();
        let kept_as = blake3::hash(&bytes);
        let (_tx, rx) = tokio::sync::watch::channel(None);
        flights.lock().unwrap().insert(*kept_as.as_bytes(), rx);
        Keep {
            cache: Arc::clone(cache),
            kept_as,
            bytes: Arc::new(bytes),
            flights: vec![kept_as],
        }
    }

    /// A keeper over a fresh 16 MiB cache in a scratch folder named for `name`.
    fn keeper_in(
        name: &str,
    ) -> (
        guestmem_testkit::Scratch,
        Arc<FrameCache>,
        Arc<Flights>,
        Keeper,
    ) {
        let scratch = guestmem_testkit::Scratch::new(name);
        let cache = Arc::new(FrameCache::open(&scratch.join("cache"), 16 << 20).unwrap());
        let flights: Arc<Flights> = Arc::new(Mutex::new(HashMap::new()));
        let keeper = Keeper::new(Arc::clone(&flights));
        (scratch, cache, flights, keeper)
    }

    #[test]
    fn frames_are_written_by_the_keeper_and_a_faults_frame_without_room_is_served_uncached() {
        let (_scratch, cache, flights, keeper) = keeper_in("keeper");

        // Background and fault frames with room: written, their flights ended once kept.
        let a = keep(&cache, &flights, 256 << 10, 3);
        let b = keep(&cache, &flights, 64 << 10, 5);
        let (ha, hb) = (a.kept_as, b.kept_as);
        run(keeper.keep(a, true));
        run(keeper.keep(b, false));
        keeper.wait(None);
        assert!(cache.contains(&ha) && cache.contains(&hb));
        assert!(flights.lock().unwrap().is_empty(), "flights ended");
        assert_eq!(
            cache.get(&ha, 256 << 10).map(|v| blake3::hash(&v)),
            Some(ha)
        );

        // No room: a fault's frame is not kept (counted), and its flight ends now.
        let all = Arc::clone(&keeper.room)
            .try_acquire_many_owned(KEEP_PENDING_KIB)
            .unwrap();
        let all_faults = Arc::clone(&keeper.faults_room)
            .try_acquire_many_owned(KEEP_PENDING_KIB)
            .unwrap();
        let c = keep(&cache, &flights, 4096, 7);
        let hc = c.kept_as;
        run(keeper.keep(c, false));
        assert!(!cache.contains(&hc));
        assert!(flights.lock().unwrap().is_empty(), "flight ended");
        assert_eq!(
            cache
                .counters
                .uncached
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );

        // A background frame waits for room, and is kept once there is some.
        let d = keep(&cache, &flights, 4096, 9);
        let hd = d.kept_as;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let keeper = Arc::new(keeper);
        let k2 = Arc::clone(&keeper);
        let waiting = rt.spawn(async move { k2.keep(d, true).await });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiting.is_finished(), "waits for room");
        drop(all_faults);
        std::thread::sleep(Duration::from_millis(20));
        assert!(!waiting.is_finished(), "not in the faults' room");
        drop(all);
        rt.block_on(waiting).unwrap();
        keeper.wait(None);
        assert!(cache.contains(&hd));
    }

    #[test]
    fn a_faults_frame_goes_to_the_writers_when_its_batch_ends() {
        let (_scratch, cache, flights, keeper) = keeper_in("keeper-batch");

        let batch = crate::batch::batch();
        let (f, b) = (
            keep(&cache, &flights, 64 << 10, 3),
            keep(&cache, &flights, 64 << 10, 5),
        );
        let (hf, hb) = (f.kept_as, b.kept_as);
        run(keeper.keep(f, false));
        run(keeper.keep(b, true));
        // The background frame is written; the fault's waits for the batch (counted, its
        // flight open, so a look joins it rather than fetching it again). The count drops
        // only after the write (the writer, at a low priority, may be held in between):
        // waited for first, it says the frame is in.
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while *keeper.unkept.count.0.lock().unwrap() != 1 && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*keeper.unkept.count.0.lock().unwrap(), 1);
        assert!(cache.contains(&hb));
        assert!(!cache.contains(&hf), "handed over before its batch ended");
        assert!(flights.lock().unwrap().contains_key(hf.as_bytes()));
        drop(batch);
        keeper.wait(None);
        assert!(cache.contains(&hf));
        assert!(flights.lock().unwrap().is_empty(), "flights ended");
    }
}
