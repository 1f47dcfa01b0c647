//! Read-ahead that yields to faults. While a fault waits on a GET of its own, no new
//! read-ahead GET on a guess starts (`Faults`, for at most [`AHEAD_DEFER_MAX`]; a recorded
//! working set's GETs toward the store do not wait: `Frames::ahead`). And how many may be
//! in flight (`AheadGate`) is set by what the store's answers say about the
//! queue they wait in, so that read-ahead yields to faults. The idea is LEDBAT's (RFC 6817,
//! the congestion control of background transfers): the least latency seen lately is the
//! store's own; anything above it is queueing, which read-ahead adds and a fault's own GET
//! then waits behind. The latency taken is a GET's time to its answer's first byte, so
//! that it does not grow with the object's size. While the queueing stays under half of
//! [`TARGET`], one more GET may go; past `TARGET` (or on a GET that failed or timed out),
//! an eighth fewer (at most once per [`CUT_EVERY`] or per least latency, whichever is
//! longer: the GETs in flight answer with the queue they met before a cut), down to
//! [`MIN`]. A store far away with bandwidth to spare keeps the limit high (its latency is
//! its own, not a queue's); a store whose link or server is saturated keeps it as low as
//! still fills it. Read-ahead on a guess takes its turns paced: no closer together than
//! the least latency over the limit (`AheadGate::paced_turn`).
//!
//! The first byte does not show a queue of bodies: a near store's answers start at once
//! and then share the link (or the CPUs that carry it). So read-ahead on a guess is also
//! held to twice the GETs the store answers in the least time a whole GET takes
//! ([`AheadGate::capped`], BBR's bound on what is in flight: its bandwidth-delay product
//! times a gain of [`RATE_GAIN`], never below [`RATE_FLOOR`]; counted in GETs, not bytes,
//! as frames stored compressed differ in size; set once a window in which every turn was
//! taken has been seen, until a quiet spell of two epochs). A fault's own GET then shares
//! the link with about one such product queued ahead of it, not with 48 bodies. In the lab (`guestmem-lab object-store
//! --only "cold 0" --latency-ms 0`, 3 interleaved pairs of 3 rounds, 2026-11-30), one cold
//! VM's wait at a frame's first touch had a p99 of 5.9-7.7 ms, against 9.8-11.5 ms
//! uncapped (the goal: 10), its scattered working set read in 0.79-0.82 s against
//! 0.83-0.94 s, and all its memory in 2.39-2.50 s against 2.09-2.35 s (7% slower, the
//! medians). A far store's bound is above the limit (at 20 ms, 600 MiB/s are 48 frames of
//! 256 KiB a whole GET, twice that 96): its limit stays (at 20 ms, 2 pairs: p99 23.3-24.2
//! ms against 25.0-25.3, all memory in 3.10-3.20 s against 3.32-3.47).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Queueing read-ahead may add to what a fault's own GET waits (the bound on a
/// demand miss is the store's first byte plus 10 ms).
pub(super) const TARGET: Duration = Duration::from_millis(10);
/// The fewest read-ahead GETs let through (enough to keep a near store busy).
pub(super) const MIN: usize = 4;
/// The least latency is taken over this long (twice: this epoch and the one before), so
/// that a store that became slower for good is not thought queued for ever.
const EPOCH: Duration = Duration::from_secs(4);
/// At most one cut this often (or once per least latency, if longer).
const CUT_EVERY: Duration = Duration::from_millis(20);
/// A capped gate's limit: this many times what the store delivers in the least time a
/// whole GET takes. Twice is BBR's: the limit doubles a window while the store delivers
/// more with more in flight, and stops where it does not (a product's worth queued).
const RATE_GAIN: f64 = 2.0;
/// A capped gate's bound is never below this: the least time a whole GET takes is seen
/// when the host is idle, and on a busy one (this rig's two CPUs, the store on them) a GET
/// takes several times that under load, so that twice the product alone held a near
/// store's read-ahead to 4 or 5, and a cold VM read all its memory about 20% slower than
/// with 48 (7% with 8), its misses' p99 no lower than with 8.
const RATE_FLOOR: usize = 8;
/// What the store answers is taken over windows of at least this (or of two least
/// whole GETs, if longer).
const RATE_WINDOW: Duration = Duration::from_millis(20);

#[derive(Debug)]
pub(super) struct AheadGate {
    sem: Arc<Semaphore>,
    max: usize,
    /// Held to [`RATE_GAIN`] times the store's bandwidth-delay product too.
    capped: bool,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Permits the gate means to have (in flight and free).
    limit: usize,
    /// Permits to forget as they come back (a cut larger than the free permits).
    debt: usize,
    /// Least latency of this epoch and of the one before.
    least: [Option<Duration>; 2],
    epoch: Instant,
    last_cut: Option<Instant>,
    /// When the last paced turn was given.
    paced: Option<Instant>,
    /// Least time a whole GET took (its last byte), this epoch and the one before.
    least_whole: [Option<Duration>; 2],
    /// Most GETs a second the store answered over a window, this epoch and the one before.
    best_rate: [Option<f64>; 2],
    /// The window under way: its start and the GETs answered since.
    window: Option<(Instant, u32)>,
    /// Whether every turn was taken at some time in the window under way: a window in which
    /// none was short of turns says what read-ahead asked for, not what the store can
    /// answer (BBR's application-limited sample).
    window_full: bool,
    /// Whether such a window has been seen (since the last quiet spell of two epochs): the
    /// bound is set only then, else a VM's first faults alone would hold a far store's
    /// read-ahead to their rate.
    rated: bool,
    /// The limit's bound from what the store delivers, never above `max` (`max` until
    /// that is known, and in a gate that is not capped).
    cap: usize,
}

/// One read-ahead GET's turn; given back (or forgotten, after a cut) on drop.
#[derive(Debug)]
pub(super) struct Turn {
    permit: Option<OwnedSemaphorePermit>,
    gate: Arc<AheadGate>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        let Some(p) = self.permit.take() else { return };
        // Given back under the lock, so that a cut never counts it as taken once it is free.
        let mut s = self.gate.lock();
        if s.debt > 0 {
            s.debt -= 1;
            p.forget();
        } else {
            drop(p);
        }
    }
}

impl AheadGate {
    /// A gate of at most `max` at once, open to all of it from the start: what read-ahead
    /// asks for first is a VM's working set, which the VM waits for, and a store shows a
    /// queue within a round trip (the gate then closes by an eighth a round trip). Opened
    /// from a quarter, a 1 GiB VM's working set (410 frames of 256 KiB) cold at 20 ms to
    /// the first byte took 0.28, 0.23 and 0.28 s to read, against 0.23, 0.26 and 0.20 s
    /// open (`guestmem-lab object-store --only file,cold,cold+ws --latency-ms 20`, 3 pairs),
    /// with no change to the faults' p99 (28.2-34.7 ms against 28.7-30.9).
    pub(super) fn new(max: usize) -> Arc<AheadGate> {
        Self::with(max, false)
    }

    /// [`AheadGate::new`], held to [`RATE_GAIN`] times what the store delivers in the least
    /// time a whole GET takes, as soon as that is known (read-ahead on a guess: see the
    /// module's docs).
    pub(super) fn capped(max: usize) -> Arc<AheadGate> {
        Self::with(max, true)
    }

    fn with(max: usize, capped: bool) -> Arc<AheadGate> {
        let max = max.max(1);
        let start = max;
        Arc::new(AheadGate {
            sem: Arc::new(Semaphore::new(start)),
            max,
            capped,
            state: Mutex::new(State {
                limit: start,
                debt: 0,
                least: [None, None],
                epoch: Instant::now(),
                last_cut: None,
                paced: None,
                least_whole: [None, None],
                best_rate: [None, None],
                window: None,
                window_full: false,
                rated: false,
                cap: max,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a turn; `None` once the gate is closed (never, today).
    pub(super) async fn turn(self: &Arc<Self>) -> Option<Turn> {
        let permit = Arc::clone(&self.sem).acquire_owned().await.ok()?;
        if self.capped && self.sem.available_permits() == 0 {
            self.lock().window_full = true;
        }
        Some(Turn {
            permit: Some(permit),
            gate: Arc::clone(self),
        })
    }

    /// Waits for a turn, turns given no closer together than the least latency seen over
    /// the limit: as many GETs in flight as the limit, started one after the other over a
    /// round trip, not all at once. Read-ahead on a guess holds back while a fault's own
    /// GET waits, and let go it took every free turn together: answers that come back
    /// together queue on the link ahead of the next fault's (the reasoning; the runs bear
    /// it out). Paced, a cold VM's demand-miss p99 at 20 ms went from 26.4-27.8 to
    /// 22.6-24.1 ms, at the same limit or a higher one. A turn waits at most a round trip
    /// for its time: no more turns than the limit wait at once.
    pub(super) async fn paced_turn(self: &Arc<Self>) -> Option<Turn> {
        let turn = self.turn().await?;
        let at = {
            let mut s = self.lock();
            let least = s.least.iter().flatten().min().copied().unwrap_or_default();
            let gap = least / s.limit.max(1) as u32;
            let now = Instant::now();
            let at = s.paced.map_or(now, |p| (p + gap).max(now));
            s.paced = Some(at);
            at
        };
        if at > Instant::now() {
            tokio::time::sleep_until(at.into()).await;
        }
        Some(turn)
    }

    /// The limit now.
    pub(super) fn limit(&self) -> usize {
        self.lock().limit
    }

    /// One GET answered from the store (read-ahead's or a fault's), its first byte after
    /// `latency`, its last after `whole`.
    pub(super) fn answered(&self, latency: Duration, whole: Duration) {
        let now = Instant::now();
        self.answered_at(latency, now);
        self.delivered_at(whole, now);
    }

    /// One GET to the store that failed or timed out: taken as a queue.
    pub(super) fn failed(&self) {
        self.failed_at(Instant::now());
    }

    fn failed_at(&self, now: Instant) {
        let mut s = self.lock();
        let least = s.least.iter().flatten().min().copied().unwrap_or_default();
        self.cut(&mut s, least, now);
    }

    fn cut(&self, s: &mut State, least: Duration, now: Instant) {
        let every = CUT_EVERY.max(least);
        let due = s.last_cut.is_none_or(|t| now.duration_since(t) >= every);
        let floor = MIN.min(self.max);
        if due && s.limit > floor {
            let cut = (s.limit - (s.limit * 7 / 8).max(floor)).max(1);
            self.lower_to(s, s.limit - cut, now);
        }
    }

    /// The limit lowered to `to`: free permits forgotten now, the rest as they come back.
    fn lower_to(&self, s: &mut State, to: usize, now: Instant) {
        let cut = s.limit - to;
        s.limit = to;
        s.last_cut = Some(now);
        let forgotten = self.sem.forget_permits(cut);
        s.debt += cut - forgotten;
    }

    fn answered_at(&self, latency: Duration, now: Instant) {
        let mut s = self.lock();
        let since = now.duration_since(s.epoch);
        if since >= EPOCH {
            // After a long quiet spell, nothing seen before it counts.
            let long = since >= 2 * EPOCH;
            s.least = [None, if long { None } else { s.least[0] }];
            s.least_whole = [None, if long { None } else { s.least_whole[0] }];
            s.best_rate = [None, if long { None } else { s.best_rate[0] }];
            if long {
                s.window = None;
                s.window_full = false;
                s.rated = false;
                s.cap = self.max;
            }
            s.epoch = now;
        }
        s.least[0] = Some(s.least[0].map_or(latency, |l| l.min(latency)));
        let least = s.least.iter().flatten().min().copied().unwrap_or(latency);
        let queued = latency.saturating_sub(least);
        if queued > TARGET {
            self.cut(&mut s, least, now);
        } else if queued <= TARGET / 2 && s.limit < s.cap {
            s.limit += 1;
            if s.debt > 0 {
                s.debt -= 1;
            } else {
                self.sem.add_permits(1);
            }
        }
    }
}

impl AheadGate {
    /// A capped gate's account of one GET's whole answer: what the store delivers over a
    /// window, the least time a whole GET takes, and the limit's bound from the two (the
    /// limit cut to it at once: the bodies queued on the link are what a fault's own waits
    /// behind).
    fn delivered_at(&self, whole: Duration, now: Instant) {
        if !self.capped {
            return;
        }
        let mut s = self.lock();
        s.least_whole[0] = Some(s.least_whole[0].map_or(whole, |l| l.min(whole)));
        let least_whole = s
            .least_whole
            .iter()
            .flatten()
            .min()
            .copied()
            .unwrap_or(whole);
        // The first answer starts the first window (it came before the window did).
        let Some((start, got)) = s.window else {
            s.window = Some((now, 0));
            return;
        };
        let got = got + 1;
        let span = now.saturating_duration_since(start);
        if span < RATE_WINDOW.max(2 * least_whole) {
            s.window = Some((start, got));
            return;
        }
        s.window = Some((now, 0));
        let full = std::mem::take(&mut s.window_full);
        if !full && !s.rated {
            return;
        }
        s.rated = true;
        let rate = f64::from(got) / span.as_secs_f64();
        s.best_rate[0] = Some(s.best_rate[0].map_or(rate, |r| r.max(rate)));
        let best = s.best_rate.iter().flatten().copied().fold(rate, f64::max);
        let product = best * least_whole.as_secs_f64();
        let cap = ((RATE_GAIN * product).ceil() as usize).clamp(RATE_FLOOR.min(self.max), self.max);
        s.cap = cap;
        if s.limit > cap {
            self.lower_to(&mut s, cap, now);
        }
    }
}

/// The longest a call of read-ahead defers to faults' own GETs before its GETs go anyway.
pub(super) const AHEAD_DEFER_MAX: Duration = Duration::from_millis(100);

/// Faults fetching a frame themselves: while any does, no new read-ahead GET on a guess
/// starts.
#[derive(Debug, Default)]
pub(super) struct Faults {
    fetching: AtomicUsize,
    /// Woken when `fetching` drops to 0.
    clear: tokio::sync::Notify,
}

/// A fault fetching a frame itself, counted until the faults read with it are installed
/// (`crate::batch`): read-ahead, woken then, neither goes ahead of their install nor costs
/// it the wake-up.
pub(super) struct FaultFirst(Arc<Faults>);

impl Faults {
    /// Counts a fault's own GET until the guard drops (and its batch ends).
    pub(super) fn first(self: &Arc<Self>) -> FaultFirst {
        self.fetching.fetch_add(1, Ordering::AcqRel);
        FaultFirst(Arc::clone(self))
    }

    /// Returns once no fault waits on a GET of its own.
    pub(super) async fn after(&self) {
        loop {
            let clear = self.clear.notified();
            tokio::pin!(clear);
            clear.as_mut().enable();
            if self.fetching.load(Ordering::Acquire) == 0 {
                return;
            }
            clear.await;
        }
    }
}

impl Drop for FaultFirst {
    fn drop(&mut self) {
        let faults = Arc::clone(&self.0);
        crate::batch::later(move || {
            if faults.fetching.fetch_sub(1, Ordering::AcqRel) == 1 {
                faults.clear.notify_waiters();
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_far_store_with_no_queue_keeps_the_gate_open_a_queued_one_closes_it_to_the_floor() {
        let g = AheadGate::new(64);
        assert_eq!(g.limit(), 64, "open from the start");
        let t0 = Instant::now();
        // 20 ms of first byte, always: the store's own latency, not a queue.
        for i in 0..100 {
            g.answered_at(ms(20), t0 + ms(i));
        }
        assert_eq!(g.limit(), 64);
        assert_eq!(g.sem.available_permits(), 64);
        // A queue builds: 40 ms answers, a cut per 20 ms at most.
        for i in 0..30 {
            g.answered_at(ms(40), t0 + ms(100 + i * 21));
        }
        assert_eq!(g.limit(), MIN);
        assert_eq!(g.sem.available_permits(), MIN);
        // The queue drains: it opens again.
        for i in 0..10 {
            g.answered_at(ms(21), t0 + ms(2000 + i));
        }
        assert_eq!(g.limit(), MIN + 10);
    }

    /// Feeds `n` answers, `gap` apart from `t0`, each whole after `whole` (its first byte
    /// after `first`).
    fn feed(g: &AheadGate, t0: Instant, n: u32, gap: Duration, first: Duration, whole: Duration) {
        for i in 1..=n {
            let now = t0 + gap * i;
            g.answered_at(first, now);
            g.delivered_at(whole, now);
        }
    }

    /// Takes every turn (each window from then on short of turns); the next answer starts
    /// a window (not the real clock's now, which the synthetic times here do not follow).
    fn take_all(g: &Arc<AheadGate>) -> Vec<Turn> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let turns = (0..g.limit())
            .map(|_| rt.block_on(g.turn()).unwrap())
            .collect();
        g.lock().window = None;
        turns
    }

    #[test]
    fn a_near_stores_guesses_are_held_to_twice_what_it_delivers_in_a_gets_least_time() {
        // 1 GiB/s, a frame of 256 KiB every 0.25 ms, each whole in 1.25 ms: 5 frames in
        // flight fill it, twice that is 10.
        let g = AheadGate::capped(48);
        let turns = take_all(&g);
        let t0 = Instant::now();
        let near = |g: &AheadGate| {
            let (gap, whole) = (Duration::from_micros(250), Duration::from_micros(1250));
            feed(g, t0, 200, gap, ms(1), whole)
        };
        near(&g);
        assert_eq!(g.limit(), 10);
        drop(turns);
        assert_eq!(
            g.sem.available_permits(),
            10,
            "the cut paid as turns came back"
        );
        // An uncapped gate (a working set's) is not held.
        let u = AheadGate::new(48);
        let turns = take_all(&u);
        near(&u);
        drop(turns);
        assert_eq!(u.limit(), 48);
    }

    #[test]
    fn a_far_stores_guesses_keep_their_limit_and_windows_never_short_of_turns_set_no_bound() {
        // 20 ms away, 600 MiB/s: 49 frames in flight fill it, twice that is more than the
        // limit.
        let g = AheadGate::capped(48);
        let turns = take_all(&g);
        let t0 = Instant::now();
        let gap = Duration::from_nanos(1_000_000_000 / 2400);
        feed(&g, t0, 1000, gap, ms(20), Duration::from_micros(20_400));
        assert_eq!(g.limit(), 48);
        drop(turns);
        // A near store whose read-ahead never took every turn (a VM's few faults): what it
        // answered is what was asked for, not what it can answer. No bound.
        let g = AheadGate::capped(48);
        feed(&g, t0, 200, ms(1), ms(1), Duration::from_micros(1250));
        assert_eq!(g.limit(), 48);
        // The floor: a store that answers little, every turn taken.
        let turns = take_all(&g);
        feed(
            &g,
            t0 + ms(300),
            200,
            ms(5),
            ms(1),
            Duration::from_micros(1250),
        );
        assert_eq!(g.limit(), RATE_FLOOR);
        drop(turns);
        // After a quiet spell of two epochs the bound goes, and the limit grows back as
        // the answers show no queue.
        feed(&g, t0 + ms(1300) + 2 * EPOCH, 20, ms(1), ms(1), ms(1));
        assert_eq!(g.lock().cap, 48);
        assert!(g.limit() > RATE_FLOOR, "{}", g.limit());
    }

    #[test]
    fn paced_turns_are_spread_over_the_least_latency() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let g = AheadGate::new(8);
        // A store 40 ms away: 8 turns a round trip, 5 ms apart.
        g.answered_at(ms(40), Instant::now());
        let t0 = Instant::now();
        let turns: Vec<Turn> = rt.block_on(async {
            let mut v = Vec::new();
            for _ in 0..8 {
                v.push(g.paced_turn().await.unwrap());
            }
            v
        });
        let took = t0.elapsed();
        assert!(took >= ms(35), "8 turns in {took:?}, not 7 gaps of 5 ms");
        drop(turns);
        // Nothing seen yet: no gap.
        let g = AheadGate::new(8);
        let t0 = Instant::now();
        rt.block_on(async {
            for _ in 0..8 {
                drop(g.paced_turn().await.unwrap());
            }
        });
        assert!(t0.elapsed() < ms(1000));
    }

    #[test]
    fn a_cut_while_every_turn_is_taken_is_paid_as_turns_come_back() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let g = AheadGate::new(16);
        assert_eq!(g.limit(), 16);
        let t0 = Instant::now();
        for i in 0..12 {
            g.answered_at(ms(1), t0 + ms(i));
        }
        assert_eq!(g.limit(), 16);
        let turns: Vec<Turn> = (0..16).map(|_| rt.block_on(g.turn()).unwrap()).collect();
        g.answered_at(ms(30), t0 + ms(100));
        assert_eq!(g.limit(), 14);
        assert_eq!(g.lock().debt, 2);
        drop(turns);
        assert_eq!(g.lock().debt, 0);
        assert_eq!(g.sem.available_permits(), 14);
        // A GET that failed is a queue too.
        g.failed_at(t0 + ms(200));
        assert_eq!(g.limit(), 12);
        assert_eq!(g.sem.available_permits(), 12);
    }

    #[test]
    fn a_store_slower_for_good_is_not_thought_queued_after_two_epochs() {
        let g = AheadGate::new(64);
        let t0 = Instant::now();
        g.answered_at(ms(1), t0);
        // Below its bound, so that it can open.
        g.failed_at(t0);
        for i in 1..=3 {
            g.answered_at(ms(50), t0 + EPOCH * i);
        }
        let before = g.limit();
        g.answered_at(ms(50), t0 + EPOCH * 3 + ms(1));
        assert_eq!(g.limit(), before + 1, "50 ms is its own latency now");
    }

    #[test]
    fn read_ahead_waits_for_a_faults_batch_to_end_not_only_its_get() {
        let faults = Arc::new(Faults::default());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let clear = |f: &Arc<Faults>| {
            rt.block_on(async { tokio::time::timeout(ms(20), f.after()).await })
                .is_ok()
        };
        assert!(clear(&faults));
        let batch = crate::batch::batch();
        drop(faults.first());
        assert!(!clear(&faults), "the fault's frame is not installed yet");
        drop(batch);
        assert!(clear(&faults));
        // Outside a batch (a reader that is not a fault handler): at once.
        drop(faults.first());
        assert!(clear(&faults));
    }
}
