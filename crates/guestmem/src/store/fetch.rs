//! Fetching frames: from the node-local cache if there, else from the store, once per host
//! however many VMs fault on a frame at once (one flight per frame, the others wait on it),
//! checked against the frame's hash, retried with backoff while the faulting vCPU waits, up
//! to a deadline. Read-ahead (`Frames::ahead`) fetches many frames at once in the
//! background, bounded, so that a fault's own GET never waits behind it: the bound shrinks
//! while the store's answers show a queue (`gate.rs`), and while a fault waits on a GET of
//! its own, no new read-ahead GET on a guess starts (for at most [`AHEAD_DEFER_MAX`] a
//! call; a recorded working set's GETs toward the store do not wait). During a move,
//! the frames the move's diff brought are owed by its source host (`Frames::follow`): they
//! are fetched from there on the same path (flights, checks, retries, the deadline) until
//! the store holds them (`Frames::release`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::cache::FrameCache;
use super::client::Client;
use super::url::frame_key;
use super::StoreError;

mod ahead;
mod counters;
mod gate;
mod keep;
mod named;
mod stage;
mod status;
pub use counters::FetchCounters;
use gate::{AheadGate, Faults, AHEAD_DEFER_MAX};
use keep::{Keep, Keeper, SETTLE_ON_DROP};
use named::Later;
use stage::Stage;
pub use status::StoreStatus;

/// How frames are fetched.
#[derive(Debug, Clone, Copy)]
pub struct FetchPolicy {
    /// How long a fault waits for its frame, retries included, before serving the VM is
    /// given up (and the VM ended, with the reason).
    pub deadline: Duration,
    /// One attempt's limit (within the deadline).
    pub attempt: Duration,
    /// Read-ahead GETs for a recorded working set in flight at once at most, all VMs
    /// together (48 by default; opening a snapshot makes as many connections ready). Fewer
    /// go while the store's answers show a queue that a fault's own GET would wait in
    /// (`fetch/gate.rs`), down to 4. In the lab (1 GiB, 20 ms to the first byte, a 1 GiB/s
    /// link) a working set read cold came in as fast with 48 as with 64, 96 or 128, and
    /// about 15% slower with 40.
    pub ahead_gets: usize,
    /// The same for read-ahead on a guess (a window past a fault, the rest of memory in
    /// order; at most `ahead_gets`): 48 by default, paced over the store's round trip
    /// (`AheadGate::paced_turn`), and held to twice the GETs the store answers in the
    /// least time a whole GET takes, 8 at least (`AheadGate::capped`: a near store's). Each
    /// GET in flight shares the link with a fault's own; docs/object-storage.md ("How many
    /// in flight") has the lab's p99 for each limit.
    pub guess_gets: usize,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy {
            deadline: Duration::from_secs(30),
            attempt: Duration::from_secs(10),
            ahead_gets: 48,
            guess_gets: 48,
        }
    }
}

/// Read-ahead GETs in flight at once toward a move's source host at most. That host serves
/// the destination's faults too, and pushes the diff to the store meanwhile: 16 GETs of
/// 256 KiB keep a 0.5 ms link busy (at 0.5 ms, 64 made a read-ahead GET wait 12.6 ms p50
/// there, and a fault 12.8 ms p99, against 5.0 and 4.1 ms with 16).
const PEER_AHEAD_GETS: usize = 16;

/// First wait between attempts; doubled after each, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(20);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Frames a move's source host owes: fetched from there until the store holds them.
#[derive(Debug)]
struct Follow {
    peer: Arc<Client>,
    owed: HashSet<[u8; 32]>,
}

type Outcome = Result<Arc<Vec<u8>>, Arc<StoreError>>;

/// Frames being fetched, each with the channel its outcome lands on.
pub(super) type Flights = Mutex<HashMap<[u8; 32], tokio::sync::watch::Receiver<Option<Outcome>>>>;

/// Fetches frames for every VM of a server.
#[derive(Debug)]
pub struct Frames {
    pub(crate) client: Arc<Client>,
    cache: Option<Arc<FrameCache>>,
    policy: FetchPolicy,
    flights: Arc<Flights>,
    /// Read-ahead's turns for a recorded working set: at most `ahead_gets`, fewer while the
    /// store's answers show a queue.
    ahead: Arc<AheadGate>,
    /// Read-ahead's turns toward a move's source host: [`PEER_AHEAD_GETS`], fixed (the
    /// source's answers do not move `ahead`, whose least latency is the store's).
    peer_ahead: Arc<AheadGate>,
    /// Read-ahead's turns toward the store for a guess (`FetchPolicy::guess_gets`).
    guess: Arc<AheadGate>,
    /// Faults waiting on a GET of their own (read-ahead on a guess, and any toward a move's
    /// source, holds back while any does).
    faults: Arc<Faults>,
    /// Writes fetched frames to the cache, after their readers have them.
    keeper: Keeper,
    /// Frames read ahead into memory, checked, for the fills that install them.
    stage: Stage,
    follow: Mutex<Option<Arc<Follow>>>,
    /// Pieces of a move's diff named later, by placeholder (while the move's VM is served).
    later: Mutex<HashMap<[u8; 32], Later>>,
    /// Whether `later` holds any (read without its lock on every fetch).
    any_later: std::sync::atomic::AtomicBool,
    /// What it did.
    pub counters: FetchCounters,
}

impl Frames {
    /// Fetches through `client`, keeping frames in `cache` (none: every read is a GET).
    pub fn new(
        client: Arc<Client>,
        cache: Option<Arc<FrameCache>>,
        policy: FetchPolicy,
    ) -> Arc<Frames> {
        let flights = Arc::new(Mutex::new(HashMap::new()));
        Arc::new(Frames {
            keeper: Keeper::new(Arc::clone(&flights)),
            stage: Stage::new(),
            client,
            cache,
            ahead: AheadGate::new(policy.ahead_gets),
            peer_ahead: AheadGate::new(PEER_AHEAD_GETS.min(policy.ahead_gets)),
            guess: AheadGate::capped(policy.guess_gets.min(policy.ahead_gets)),
            policy,
            flights,
            faults: Arc::default(),
            follow: Mutex::new(None),
            later: Mutex::new(HashMap::new()),
            any_later: std::sync::atomic::AtomicBool::new(false),
            counters: FetchCounters::default(),
        })
    }

    /// The cache, if any.
    pub fn cache(&self) -> Option<&Arc<FrameCache>> {
        self.cache.as_ref()
    }

    /// The client.
    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    /// The policy.
    pub fn policy(&self) -> FetchPolicy {
        self.policy
    }

    /// From now on, the frames `owed` come from a move's source host `peer`, on the same
    /// path as the store's (one flight per frame, checked against its hash, retried up to
    /// the deadline), until [`Frames::release`].
    pub fn follow(&self, peer: Arc<Client>, owed: impl IntoIterator<Item = blake3::Hash>) {
        let owed = owed.into_iter().map(|h| *h.as_bytes()).collect();
        *self.follow.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Arc::new(Follow { peer, owed }));
    }

    /// The store holds what the source host owed: every fetch from now on goes there (an
    /// attempt in flight to the source finishes; its retries go to the store).
    pub fn release(&self) {
        self.follow.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    /// Whether a move's source host still owes frames.
    pub fn following(&self) -> bool {
        self.follow
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Where the next attempt at `hash` goes: the source host while it owes it, else the
    /// store.
    fn holder(&self, hash: &blake3::Hash) -> Option<Arc<Client>> {
        let f = self.follow.lock().unwrap_or_else(|e| e.into_inner());
        f.as_ref()
            .filter(|f| f.owed.contains(hash.as_bytes()))
            .map(|f| Arc::clone(&f.peer))
    }

    /// Waits until no fetched frame waits to be written to the cache (each kept, or given up:
    /// no room, a disk error); frames fetched meanwhile are waited for too, so a caller whose
    /// fetches are done (a host warmed ahead) finds them all in the cache after it, but one
    /// that calls it while read-ahead goes on waits for that as well. Frames are handed to
    /// their readers before they are written: a caller that needs them in the cache waits
    /// here. Not from an async task (it blocks its thread).
    pub fn settle(&self) {
        self.keeper.wait(None);
    }

    /// The frame of `hash` into `dst` (its length) if the cache holds it (or it is a piece
    /// named later that the store holds as zeros): no fetch.
    pub(crate) fn read_cached(&self, hash: &blake3::Hash, dst: &mut [u8]) -> bool {
        let key = match self.later_of(hash) {
            None | Some(Later::Pending) => *hash,
            Some(Later::Zero) => {
                dst.fill(0);
                return true;
            }
            Some(Later::Served(h) | Later::Named(h)) => h,
        };
        if let Some(b) = self.take_from_stage(&key, dst.len()) {
            dst.copy_from_slice(&b);
            self.stage.give_back(b);
            return true;
        }
        // A frame it cannot give is counted once, by the fetch that follows.
        self.cache.as_ref().is_some_and(|c| c.read_into(&key, dst))
    }

    /// The frame of `hash` (`len` plain bytes), from a thread outside the runtime.
    pub(crate) fn get(self: &Arc<Self>, hash: &blake3::Hash, len: usize) -> Outcome {
        self.client.block_on(self.get_async(*hash, len))
    }

    /// The frame of `hash`: from the cache, from a flight already fetching it, or fetched.
    /// The deadline is this caller's own: one that joined a flight which ran out of its
    /// time (it started earlier) and has time left fetches on with what it has left.
    pub(crate) async fn get_async(self: &Arc<Self>, hash: blake3::Hash, len: usize) -> Outcome {
        let (start, mut joined) = (Instant::now(), false);
        loop {
            match self.try_get(hash, len, start, &mut joined).await {
                Err(e)
                    if matches!(*e, StoreError::Deadline { .. })
                        && start.elapsed() < self.policy.deadline =>
                {
                    // The flight it joined has landed (its error sent first): let it go.
                    tokio::task::yield_now().await;
                }
                other => return other,
            }
        }
    }

    /// [`Frames::get_async`] once, its deadline counted from `start`; `joined` once it has
    /// joined a flight (counted once a caller, however many it joins in turn).
    async fn try_get(
        self: &Arc<Self>,
        hash: blake3::Hash,
        len: usize,
        start: Instant,
        joined: &mut bool,
    ) -> Outcome {
        // A piece named later: under the hash it was served or named as, while known.
        let (hash, cached) = match self.later_of(&hash) {
            None => (hash, Some(hash)),
            Some(Later::Zero) => return Ok(Arc::new(vec![0u8; len])),
            Some(Later::Named(h)) => (h, Some(h)),
            Some(Later::Served(h)) => (hash, Some(h)),
            Some(Later::Pending) => (hash, None),
        };
        if let Some(p) = cached.and_then(|h| self.take_from_stage(&h, len)) {
            return Ok(p);
        }
        if let Some(p) = cached.and_then(|h| self.cache.as_ref().and_then(|c| c.get(&h, len))) {
            return Ok(Arc::new(p));
        }
        let tx = {
            let mut f = self.flights.lock().unwrap_or_else(|e| e.into_inner());
            match f.get(hash.as_bytes()) {
                Some(rx) => Err(rx.clone()),
                None => {
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    f.insert(*hash.as_bytes(), rx);
                    Ok(tx)
                }
            }
        };
        match tx {
            Err(rx) => {
                if !std::mem::replace(joined, true) {
                    self.counters.joined.fetch_add(1, Ordering::Relaxed);
                }
                // A flight is shared by hash alone: one asked for with another length (a
                // manifest that names one frame with two) is refused here, as its own GET's
                // check would refuse it, never handed bytes of the wrong length (every other
                // way here, the stage, the cache and a GET, checks the length it is asked).
                match wait(rx).await {
                    Ok(b) if b.len() != len => Err(Arc::new(StoreError::Frame {
                        url: self.client.url(&frame_key(&hash)),
                        reason: format!(
                            "{} bytes, where the manifest names it with {len}",
                            b.len()
                        ),
                    })),
                    other => other,
                }
            }
            Ok(tx) => {
                // A fault's own GET goes ahead of read-ahead (a prefetch thread's does not).
                let _first = (!crate::restore::is_prefetcher()).then(|| self.faults.first());
                self.lead(hash, len, tx, false, start).await
            }
        }
    }

    /// Fetches a frame this caller registered the flight of, and lands it for everyone.
    async fn lead(
        self: &Arc<Self>,
        hash: blake3::Hash,
        len: usize,
        tx: tokio::sync::watch::Sender<Option<Outcome>>,
        ahead: bool,
        start: Instant,
    ) -> Outcome {
        // A flight that ended between our cache look-up and registering this one left the
        // frame in the cache.
        let kept = self.kept_as(&hash);
        let cached = self
            .cache
            .as_ref()
            .and_then(|c| c.contains(&kept).then(|| c.get(&kept, len)).flatten());
        let (out, keep) = match cached {
            Some(p) => (Ok(Arc::new(p)), None),
            None => match self.fetch(hash, len, ahead, start).await {
                Ok((p, keep)) => {
                    let p = Arc::new(p);
                    if let Some(kept_as) = keep.filter(|_| ahead) {
                        // Installed from memory when the prefetch gets to it, not read back
                        // from the cache.
                        self.stage.put(&kept_as, &p);
                    }
                    let keep = self.cache.clone().zip(keep).map(|(cache, kept_as)| Keep {
                        cache,
                        kept_as,
                        bytes: Arc::clone(&p),
                        flights: vec![hash],
                    });
                    (Ok(p), keep)
                }
                Err(e) => (Err(Arc::new(e)), None),
            },
        };
        // Its readers first: writing it to the cache must not stand between a fault and its
        // bytes. Its flight stays until it is kept, so that a look meanwhile joins it instead
        // of fetching it again; so does one under the hash it is kept as (a piece of a move's
        // diff named later), which a look asks for once the piece is named.
        let _ = tx.send(Some(out.clone()));
        match keep {
            None => self.keeper.landed(&[hash]),
            Some(mut k) => {
                if k.kept_as != hash {
                    let mut f = self.flights.lock().unwrap_or_else(|e| e.into_inner());
                    if !f.contains_key(k.kept_as.as_bytes()) {
                        f.insert(*k.kept_as.as_bytes(), tx.subscribe());
                        k.flights.push(k.kept_as);
                    }
                }
                let background = ahead || crate::restore::is_prefetcher();
                self.keeper.keep(k, background).await;
            }
        }
        out
    }

    /// GETs a frame until it arrives whole and right, or the deadline passes. A frame whose
    /// bytes fail their check is fetched once more, then given up. With its bytes, the hash
    /// to keep them under (none: not kept). A piece named later is fetched under its
    /// placeholder until the store names it, then under that name.
    async fn fetch(
        &self,
        asked: blake3::Hash,
        len: usize,
        ahead: bool,
        t0: Instant,
    ) -> Result<(Vec<u8>, Option<blake3::Hash>), StoreError> {
        let mut backoff = FIRST_BACKOFF;
        let mut attempts = 0u32;
        let mut mismatched = false;
        loop {
            let (hash, named_later) = match self.later_of(&asked) {
                None => (asked, false),
                Some(Later::Zero) => return Ok((vec![0u8; len], None)),
                Some(Later::Named(h)) => (h, false),
                Some(Later::Pending | Later::Served(_)) => (asked, true),
            };
            let key = frame_key(&hash);
            let left = self.policy.deadline.saturating_sub(t0.elapsed());
            if left.is_zero() && attempts > 0 {
                return Err(StoreError::Deadline {
                    url: self
                        .holder(&hash)
                        .as_ref()
                        .unwrap_or(&self.client)
                        .url(&key),
                    deadline: self.policy.deadline,
                    attempts,
                    last: "no attempt finished in time".into(),
                });
            }
            let peer = self.holder(&hash);
            if named_later && peer.is_none() {
                // Named and released since the look above: fetched under its name now.
                if matches!(self.later_of(&asked), Some(Later::Named(_) | Later::Zero)) {
                    continue;
                }
                return Err(StoreError::Frame {
                    url: self.client.url(&key),
                    reason: "a piece of a move's diff, not yet named by the store, and no source to ask for it".into(),
                });
            }
            attempts += 1;
            let client = peer.as_ref().unwrap_or(&self.client);
            self.counters.gets.fetch_add(1, Ordering::Relaxed);
            if peer.is_some() {
                self.counters.peer_gets.fetch_add(1, Ordering::Relaxed);
            }
            let sent = Instant::now();
            let max = (len + super::frame::HEADER_BYTES + super::frame::named_prefix(true)) as u64;
            let limit = left.min(self.policy.attempt);
            let fault = peer.is_none() && !ahead && !crate::restore::is_prefetcher();
            let direct = peer
                .as_ref()
                .and_then(|p| p.direct())
                .filter(|_| !ahead && super::direct::reads_here());
            let got = match direct {
                Some(d) => d.get_here(&key, max, limit, || client.url(&key)).await,
                // A fault's own GET to the store goes on the client's fault lane.
                None if fault => client.get_fault(&key, max, limit).await,
                None => tokio::time::timeout(limit, client.get_capped(&key, max))
                    .await
                    .map_err(|_| ()),
            };
            let last = match got {
                Ok(Ok(Some((obj, first_byte)))) => {
                    self.counters.latency.record(sent.elapsed());
                    if peer.is_none() {
                        self.ahead.answered(first_byte, sent.elapsed());
                        self.guess.answered(first_byte, sent.elapsed());
                    }
                    self.counters.bytes.fetch_add(obj.len() as u64, Ordering::Relaxed);
                    if peer.is_some() {
                        self.counters.peer_latency.record(sent.elapsed());
                        if !ahead && !crate::restore::is_prefetcher() {
                            self.counters.peer_fault_latency.record(sent.elapsed());
                        }
                        self.counters
                            .peer_bytes
                            .fetch_add(obj.len() as u64, Ordering::Relaxed);
                    }
                    let decoded = match named_later {
                        false => super::frame::decode(obj, len, &hash).map(|p| (p, hash)),
                        true => super::frame::decode_named(
                            obj,
                            len,
                            client.seal().map(|k| (k, &asked)),
                        ),
                    };
                    match decoded {
                        Ok((p, h)) if named_later => {
                            self.served(&asked, h, len)
                                .map_err(|reason| StoreError::Frame {
                                    url: client.url(&key),
                                    reason,
                                })?;
                            return Ok((p, Some(h)));
                        }
                        Ok((p, h)) => return Ok((p, Some(h))),
                        Err(why) => {
                            self.counters.mismatches.fetch_add(1, Ordering::Relaxed);
                            if mismatched {
                                return Err(StoreError::Frame {
                                    url: client.url(&key),
                                    reason: format!("{why} (fetched twice)"),
                                });
                            }
                            mismatched = true;
                            continue;
                        }
                    }
                }
                Ok(Ok(None)) => {
                    return Err(StoreError::Frame {
                        url: client.url(&key),
                        reason: match peer.is_some() {
                            true => "not served by the move's source (it holds no such frame)".into(),
                            false => "not in the bucket (collected while a manifest still names it, or never pushed whole)".into(),
                        },
                    })
                }
                Ok(Err(e)) if !e.is_transient() => return Err(e),
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {:?}", left.min(self.policy.attempt)),
            };
            if peer.is_none() {
                self.ahead.failed();
                self.guess.failed();
            }
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            let left = self.policy.deadline.saturating_sub(t0.elapsed());
            if left.is_zero() {
                return Err(StoreError::Deadline {
                    url: client.url(&key),
                    deadline: self.policy.deadline,
                    attempts,
                    last,
                });
            }
            match fault {
                true => client.fault_backoff(backoff.min(left)).await,
                false => tokio::time::sleep(backoff.min(left)).await,
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
}

impl Drop for Frames {
    /// The frames fetched are kept before it goes (a server stopped keeps what it fetched),
    /// waiting at most [`SETTLE_ON_DROP`] for a slow disk (the writer threads need nothing
    /// of the dropping thread, a runtime's included).
    fn drop(&mut self) {
        self.keeper.wait(Some(SETTLE_ON_DROP));
    }
}

async fn wait(mut rx: tokio::sync::watch::Receiver<Option<Outcome>>) -> Outcome {
    match rx.wait_for(|v| v.is_some()).await {
        Ok(v) => v.clone().expect("waited for"),
        // The leader went without landing it (it cannot: it sends before it returns); a
        // second look goes through the cache or a new flight.
        Err(_) => Err(Arc::new(StoreError::Frame {
            url: String::new(),
            reason: "its fetch was abandoned".into(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use guestmem_testkit::s3::S3Server;
    use guestmem_testkit::Scratch;

    use super::{FetchPolicy, Frames, AHEAD_DEFER_MAX};
    use crate::snapshot::{Ahead, RemoteMemory};
    use crate::store::url::frame_key;
    use crate::store::{push, Client, PushConfig, PushSource, StoreMemory, StoreUrl};

    const FB: u64 = 64 << 10;
    const FRAMES: u64 = 48;

    fn client(s3: &S3Server) -> Arc<Client> {
        let env = s3.env();
        let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        Arc::new(Client::connect_with("snaps", &get).unwrap())
    }

    /// A raw snapshot of [`FRAMES`] frames, every word its own offset (no two frames alike),
    /// pushed uncompressed to a fresh S3 server; and a client of its own to read it (none of
    /// the push's connections in its pool).
    fn pushed(name: &str) -> (Scratch, S3Server, Arc<Client>, StoreUrl) {
        let scratch = Scratch::new(name);
        let s3 = S3Server::start(name, &["snaps"]);
        let raw = scratch.join("mem");
        let words: Vec<u8> = (0..FRAMES * FB / 8)
            .flat_map(|w| (w * 8 + 1).to_le_bytes())
            .collect();
        std::fs::write(&raw, &words).unwrap();
        let url = StoreUrl::parse("s3://snaps/vm", false).unwrap();
        let cfg = PushConfig {
            frame_bytes: FB,
            compress: false,
            ..PushConfig::default()
        };
        push(&client(&s3), &PushSource::Raw(raw), &url, &cfg).unwrap();
        let reader = client(&s3);
        (scratch, s3, reader, url)
    }

    fn policy(ahead_gets: usize) -> FetchPolicy {
        FetchPolicy {
            ahead_gets,
            ..FetchPolicy::default()
        }
    }

    /// Read-ahead asked for a working set fetches it in the order asked (one turn: the GETs
    /// go one after another), and does not hold back while a fault fetches a frame of its
    /// own: all of it comes in well before a guess would have (each of which defers to the
    /// fault for [`AHEAD_DEFER_MAX`]).
    #[test]
    fn a_working_set_is_fetched_in_the_order_asked_and_past_a_faults_own_get() {
        let (_scratch, s3, client, url) = pushed("ahead-order");
        let frames = Frames::new(client, None, policy(1));
        let memory = StoreMemory::open(Arc::clone(&frames), &url).unwrap();
        let snap = memory.snapshot();
        // Every frame once, in an order of no pattern (a stride coprime with the count).
        let order: Vec<u64> = (0..FRAMES).map(|i| (i * 29 + 7) % FRAMES).collect();
        let asked: Vec<_> = order
            .iter()
            .map(|&i| (snap.frames[i as usize][0].hash, FB as usize))
            .collect();
        s3.log_gets();
        // A fault waits on a GET of its own until its batch ends (this test's end).
        let _batch = crate::batch::batch();
        drop(frames.faults.first());
        let t0 = Instant::now();
        frames.ahead(&asked, Ahead::Wanted, None);
        let deadline = t0 + Duration::from_secs(60);
        // Every GET gone, come to the server and landed (its flight ended: no cache).
        let landed = || {
            frames.counters.gets.load(Ordering::Relaxed) >= FRAMES
                && s3.gets().len() >= FRAMES as usize
                && frames.flights.lock().unwrap().is_empty()
        };
        while !landed() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let took = t0.elapsed();
        let want: Vec<String> = asked.iter().map(|(h, _)| frame_key(h)).collect();
        assert_eq!(s3.gets(), want, "one GET a frame, in the order asked");
        assert!(
            took < AHEAD_DEFER_MAX * FRAMES as u32,
            "{took:?}: held back for the fault"
        );
    }

    /// A fault that joins another's GET of its frame keeps its own deadline: the store
    /// stops answering, a fault starts a GET (deadline 4 s), a second fault on the same
    /// frame joins it 3 s later, the store answers again after 4.2 s. The first fault gives
    /// up at its deadline; the second, with 3 s of its own left, fetches on and gets the
    /// frame. Before, it took the first's deadline as its own: a short store outage ended
    /// every VM that came to a frame late.
    #[test]
    fn a_fault_that_joined_a_get_keeps_its_own_deadline() {
        let (_scratch, s3, client, url) = pushed("joined-deadline");
        let frames = Frames::new(
            client,
            None,
            FetchPolicy {
                deadline: Duration::from_secs(4),
                attempt: Duration::from_millis(500),
                ..policy(1)
            },
        );
        let memory = StoreMemory::open(Arc::clone(&frames), &url).unwrap();
        let hash = memory.snapshot().frames[3][0].hash;
        s3.delay_gets(Duration::from_secs(60));
        let t0 = Instant::now();
        let get = |frames: Arc<Frames>| std::thread::spawn(move || frames.get(&hash, FB as usize));
        let first = get(Arc::clone(&frames));
        std::thread::sleep(Duration::from_secs(3));
        let second = get(Arc::clone(&frames));
        while t0.elapsed() < Duration::from_millis(4200) {
            std::thread::sleep(Duration::from_millis(10));
        }
        s3.delay_gets(Duration::ZERO);
        let e = first.join().unwrap().expect_err("past its deadline");
        assert!(
            matches!(*e, crate::store::StoreError::Deadline { .. }),
            "{e}"
        );
        let got = second
            .join()
            .unwrap()
            .expect("served within its own deadline");
        assert_eq!(got.len(), FB as usize);
        let word = u64::from_le_bytes(got[..8].try_into().unwrap());
        assert_eq!(word, 3 * FB + 1, "frame 3's first word");
        assert!(t0.elapsed() < Duration::from_secs(7), "{:?}", t0.elapsed());
        // Once for the second fault, however many flights it joined (none, if it was held up
        // past the first's deadline and led its own).
        assert!(frames.counters.joined.load(Ordering::Relaxed) <= 1);
    }

    /// Read-ahead asked for by something that then goes (a VM's image, its VM ended)
    /// fetches no more once it has gone: the GETs in flight land, and no other is sent.
    /// (Before, a detached task fetched the whole working set of every VM that came and
    /// went.) One GET at a time, each answered 20 ms late.
    #[test]
    fn read_ahead_for_what_has_gone_stops() {
        let (_scratch, s3, client, url) = pushed("ahead-gone");
        let frames = Frames::new(client, None, policy(1));
        let memory = StoreMemory::open(Arc::clone(&frames), &url).unwrap();
        let snap = memory.snapshot();
        let asked: Vec<_> = (0..FRAMES as usize)
            .map(|i| (snap.frames[i][0].hash, FB as usize))
            .collect();
        s3.delay_gets(Duration::from_millis(20));
        s3.log_gets();
        let alive = Arc::new(());
        frames.ahead(&asked, Ahead::Wanted, Some(Arc::downgrade(&alive)));
        let t0 = Instant::now();
        while s3.gets().len() < 2 {
            assert!(t0.elapsed() < Duration::from_secs(30), "no read-ahead");
            std::thread::sleep(Duration::from_millis(2));
        }
        // Read after the drop: the test's thread may be held between the two, and
        // read-ahead's GETs before the drop count for nothing.
        drop(alive);
        let at_drop = s3.gets().len();
        // The GET in flight lands, and one whose turn came as it went may go too; then
        // nothing more (no new GET for 300 ms: 15 of them, had it gone on).
        let mut seen = (s3.gets().len(), Instant::now());
        while seen.1.elapsed() < Duration::from_millis(300) {
            std::thread::sleep(Duration::from_millis(5));
            let n = s3.gets().len();
            if n != seen.0 {
                seen = (n, Instant::now());
            }
            assert!(
                n < FRAMES as usize,
                "every frame fetched after what asked had gone"
            );
        }
        assert!(
            seen.0 <= at_drop + 2,
            "{} GETs after what asked had gone ({at_drop} before)",
            seen.0 - at_drop
        );
    }

    /// A snapshot's opening makes its connections ready: as many GETs at once as read-ahead
    /// may have in flight find them open in the client's pool, and as many faults' own GETs
    /// as the fault lane opens ahead find them open in the lane's. The store answers HEADs
    /// 50 ms late, as one elsewhere does: a HEAD answered at once gives its connection back
    /// to the pool, and the next HEAD may take it instead of opening its own. (The pool may
    /// also give a request a connection another just let go of while its own is still
    /// being made, so one connection either way is not counted against it.)
    #[test]
    fn opening_a_snapshot_makes_its_connections_ready() {
        const AT_ONCE: u64 = 8;
        const LANE: u64 = super::super::client::LANE_WARM as u64;
        let (_scratch, s3, client, url) = pushed("warm");
        // The server's count once no connection has come for 100 ms.
        let settled = || {
            let (mut last, until) = (s3.connections(), Instant::now() + Duration::from_secs(5));
            loop {
                std::thread::sleep(Duration::from_millis(100));
                let n = s3.connections();
                if n == last || Instant::now() > until {
                    return n;
                }
                last = n;
            }
        };
        let frames = Frames::new(client, None, policy(AT_ONCE as usize));
        s3.delay_heads(Duration::from_millis(50));
        let before = settled();
        // The manifest's GET answered 300 ms late: the opening then waits up to its most
        // (2 s) for the connections, not its least (250 ms, which a runtime's threads
        // held up on this busy host may miss).
        s3.delay_gets(Duration::from_millis(300));
        let memory = StoreMemory::open(Arc::clone(&frames), &url).unwrap();
        s3.delay_gets(Duration::ZERO);
        let opened = settled() - before;
        assert!(opened >= AT_ONCE + LANE - 2, "{opened} connections opened");
        let check = |got: &[u8], from: u64| {
            got.chunks(8)
                .enumerate()
                .all(|(w, b)| u64::from_le_bytes(b.try_into().unwrap()) == from + w as u64 * 8 + 1)
        };
        // AT_ONCE frames read in one go by a prefetch thread, through the client's pool:
        // their GETs go side by side.
        let m2 = memory.clone();
        let got = std::thread::spawn(move || {
            crate::restore::as_prefetcher();
            let mut got = vec![0u8; (AT_ONCE * FB) as usize];
            m2.read(FB, &mut got).unwrap();
            got
        })
        .join()
        .unwrap();
        assert_eq!(frames.counters.gets.load(Ordering::Relaxed), AT_ONCE);
        assert!(check(&got, FB));
        let more = settled() - before - opened;
        assert!(more <= 1, "{more} connections opened for read-ahead's GETs");
        // LANE frames read in one go by a fault, through the lane's pool.
        let from = 16 * FB;
        let mut got = vec![0u8; (LANE * FB) as usize];
        memory.read(from, &mut got).unwrap();
        assert_eq!(frames.counters.gets.load(Ordering::Relaxed), AT_ONCE + LANE);
        assert!(check(&got, from));
        let more = settled() - before - opened - more;
        assert!(more <= 1, "{more} connections opened for faults' GETs");
    }

    /// A fault's own GET is answered while the client's runtime, where read-ahead's GETs
    /// run, cannot run anything: it goes on the fault lane, a pool and a runtime of its own.
    /// Both of the runtime's threads are held here; a GET sent through it meanwhile (on the
    /// path read-ahead takes) is answered only once they are let go.
    #[test]
    fn a_faults_get_is_answered_while_the_clients_runtime_is_held() {
        let (_scratch, _s3, client, url) = pushed("fault-lane");
        let frames = Frames::new(Arc::clone(&client), None, policy(1));
        let memory = StoreMemory::open(Arc::clone(&frames), &url).unwrap();
        let snap = memory.snapshot().clone();

        // Lets the held threads go when dropped (a failed assertion too).
        struct Held(Vec<std::sync::mpsc::Sender<()>>);
        impl Drop for Held {
            fn drop(&mut self) {
                for t in &self.0 {
                    let _ = t.send(());
                }
            }
        }
        let (started_tx, started) = std::sync::mpsc::channel();
        let mut held = Held(Vec::new());
        for _ in 0..super::super::client::RUNTIME_THREADS {
            let (go, wait) = std::sync::mpsc::channel::<()>();
            held.0.push(go);
            let started_tx = started_tx.clone();
            client.handle().spawn(async move {
                started_tx.send(()).unwrap();
                // Blocks this runtime thread (at most a minute, whatever the test does).
                let _ = wait.recv_timeout(Duration::from_secs(60));
            });
        }
        for _ in 0..super::super::client::RUNTIME_THREADS {
            started
                .recv_timeout(Duration::from_secs(20))
                .expect("every runtime thread held");
        }

        // Through the runtime: frame 1, as read-ahead fetches it.
        let (via_rt, via_rt_got) = std::sync::mpsc::channel();
        let key = frame_key(&snap.frames[1][0].hash);
        let c2 = Arc::clone(&client);
        let through_rt = std::thread::spawn(move || {
            let got = c2.block_on(c2.get_capped(&key, FB + 1024));
            let _ = via_rt.send(got.map(|g| g.map(|(b, _)| b.len())));
        });
        // A fault on frame 0, on a thread of its own (a fault waits on its own thread).
        let (faulted, fault_got) = std::sync::mpsc::channel();
        let m2 = memory.clone();
        let fault = std::thread::spawn(move || {
            let mut got = vec![0u8; FB as usize];
            let r = crate::snapshot::RemoteMemory::read(&m2, 0, &mut got);
            let _ = faulted.send(r.map(|()| got).map_err(|e| e.to_string()));
        });
        let got = fault_got
            .recv_timeout(Duration::from_secs(20))
            .expect("the fault answered while the runtime is held")
            .unwrap();
        assert!(got
            .chunks(8)
            .enumerate()
            .all(|(w, b)| u64::from_le_bytes(b.try_into().unwrap()) == w as u64 * 8 + 1));
        assert!(
            via_rt_got.try_recv().is_err(),
            "a GET through the held runtime answered: it was not held"
        );
        drop(held);
        let len = via_rt_got
            .recv_timeout(Duration::from_secs(20))
            .expect("the GET through the runtime answered once it was let go")
            .unwrap();
        assert_eq!(len, Some(FB as usize + crate::store::frame::HEADER_BYTES));
        fault.join().unwrap();
        through_rt.join().unwrap();
        assert_eq!(frames.counters.gets.load(Ordering::Relaxed), 1);
    }
}
