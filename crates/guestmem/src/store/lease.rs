//! A push's lease in the bucket (`leases/`): written when a push starts, renewed while it
//! runs, deleted when it ends; `gc` deletes nothing while one younger than [`LEASE_STALE`]
//! is there. A running gc marks itself too (`leases/gc/`), and a push that finds a live
//! mark once its lease is written waits, before it looks at any frame, until the gc has
//! gone: the gc sees the push's lease before its next batch of deletes and stops. Each
//! writes its own mark first and looks for the other's after, so one of the two always
//! sees the other. Ages are read on the store's clock (an object's `LastModified` against
//! that of a mark just written), never against this host's.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::client::{Client, Listed};
use super::url::{StoreUrl, LEASES};
use super::StoreError;

/// A time on `CLOCK_BOOTTIME`: unlike `Instant` (`CLOCK_MONOTONIC`), it runs on while
/// the host is suspended, as the store's clock does. A host suspended for longer than
/// [`LEASE_STALE`] mid-push must see that gap, not a short one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Boot(Duration);

impl Boot {
    fn now() -> Boot {
        // SAFETY: timespec is plain data, for which all zeros is a valid value.
        let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
        // SAFETY: clock_gettime writes one timespec into a live struct; CLOCK_BOOTTIME is
        // always there (Linux 2.6.39 and later).
        unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
        Boot(Duration::new(
            ts.tv_sec.max(0) as u64,
            ts.tv_nsec.clamp(0, 999_999_999) as u32,
        ))
    }

    fn elapsed(self) -> Duration {
        Boot::now().0.saturating_sub(self.0)
    }

    fn saturating_duration_since(self, earlier: Boot) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    #[cfg(test)]
    fn checked_sub(self, d: Duration) -> Option<Boot> {
        self.0.checked_sub(d).map(Boot)
    }
}

/// How long a push's lease stays good without being renewed; gc treats an older one as a
/// push that died.
pub const LEASE_STALE: Duration = Duration::from_secs(600);
/// How often a running push renews its lease.
pub(super) const LEASE_RENEW: Duration = Duration::from_secs(60);
/// Where a running gc marks itself: a folder under `leases/` that no push's lease can be
/// (a push's lease has no `/` past `leases/`).
pub(super) const GC_MARKS: &str = "leases/gc/";
/// How often a push waiting on a gc looks again.
const GC_POLL: Duration = Duration::from_secs(1);
/// How long a gc's mark is renewed after a renewal found a push waiting: a gc stops at its
/// next request once it has, so one that has not gone by then is held up (a request that
/// does not return), and its mark is left to go stale so that the push can go on (a gc
/// that then wakes finds its mark unwritten past [`LEASE_HELD`] and deletes nothing).
pub(super) const GC_YIELD: Duration = LEASE_RENEW;
/// The longest a push waits for a gc's mark to go: the gc's renewals for [`GC_YIELD`] after
/// it saw the push, one renewal's period late, then [`LEASE_STALE`] until the mark is stale.
const GC_WAIT: Duration =
    Duration::from_secs(LEASE_STALE.as_secs() + GC_YIELD.as_secs() + 2 * LEASE_RENEW.as_secs());

/// The store's clock now, seconds: the `LastModified` of `key`, just written, in a listing
/// of `prefix`.
fn store_now(client: &Client, prefix: &str, key: &str) -> Result<(i64, Vec<Listed>), StoreError> {
    let listed = client.list(prefix)?;
    let now = listed
        .iter()
        .find(|l| l.key == key)
        .map(|l| l.modified)
        .ok_or_else(|| StoreError::Request {
            op: "LIST",
            url: client.url(key),
            reason: "a mark just written is not in the listing (a store that lists late \
                     cannot keep a gc from a push)"
                .into(),
            permanent: true,
        })?;
    Ok((now, listed))
}

/// A push's lease younger than [`LEASE_STALE`] at the store's `now`, in `listed`.
pub(super) fn live_push(listed: &[Listed], now: i64) -> Option<String> {
    listed
        .iter()
        .filter(|l| !l.key.starts_with(GC_MARKS))
        .find(|l| now - l.modified < LEASE_STALE.as_secs() as i64)
        .map(|l| l.key.clone())
}

/// A running gc's mark in the bucket, deleted when dropped. Like a push's lease, it must
/// never go unwritten for longer than [`LEASE_HELD`]: a push that finds it stale goes on,
/// and may skip a frame the gc then deletes. gc renews it every [`LEASE_RENEW`] from a
/// thread of its own for the whole run (reading the manifests and listing the frames of a
/// large bucket take minutes), and checks it was held before every batch of deletes.
pub(super) struct GcMark<'a> {
    client: &'a Client,
    key: String,
    held: Mutex<Held>,
    /// A renewal found a push in progress: gc stops before it deletes anything more.
    push_seen: std::sync::atomic::AtomicBool,
    /// When a renewal first found one ([`GC_YIELD`]).
    push_seen_at: Mutex<Option<Boot>>,
}

impl<'a> GcMark<'a> {
    /// Writes it; with the leases as the store lists them just after, and its clock then.
    pub(super) fn take(client: &'a Client) -> Result<(GcMark<'a>, i64, Vec<Listed>), StoreError> {
        let key = format!("{GC_MARKS}{}.{}", std::process::id(), nanos());
        let t = Boot::now();
        let mark = GcMark {
            client,
            key,
            held: Mutex::new(Held {
                tried: t,
                written: t,
                longest_gap: Duration::ZERO,
            }),
            push_seen: std::sync::atomic::AtomicBool::new(false),
            push_seen_at: Mutex::new(None),
        };
        let (now, listed) = mark.renew()?;
        Ok((mark, now, listed))
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes it again: the leases as listed just after, and the store's clock then.
    pub(super) fn renew(&self) -> Result<(i64, Vec<Listed>), StoreError> {
        let sent = Boot::now();
        self.held().tried = sent;
        self.client
            .put(&self.key, Bytes::from_static(b"{\"gc\":true}"))?;
        let mut h = self.held();
        h.longest_gap = h.longest_gap.max(sent.saturating_duration_since(h.written));
        // Two renewals at once (gc's thread and a batch's) may end out of order.
        h.written = h.written.max(sent);
        drop(h);
        let (now, listed) = store_now(self.client, LEASES, &self.key)?;
        if live_push(&listed, now).is_some() {
            self.push_seen
                .store(true, std::sync::atomic::Ordering::Relaxed);
            let mut at = self.push_seen_at.lock().unwrap_or_else(|e| e.into_inner());
            at.get_or_insert_with(Boot::now);
        }
        Ok((now, listed))
    }

    /// Whether a renewal has found a push in progress (which waits for this gc to go).
    pub(super) fn push_seen(&self) -> bool {
        self.push_seen.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Runs `work` while a thread writes the mark again every [`LEASE_RENEW`] (a failure
    /// is left to [`GcMark::check_held`]), until [`GC_YIELD`] after a push was seen.
    pub(super) fn renewed_while<T>(&self, work: impl FnOnce() -> T) -> T {
        self.renewed_every(LEASE_RENEW, GC_YIELD, work)
    }

    fn renewed_every<T>(
        &self,
        every: Duration,
        yield_after: Duration,
        work: impl FnOnce() -> T,
    ) -> T {
        let renew = || {
            let seen = *self.push_seen_at.lock().unwrap_or_else(|e| e.into_inner());
            if seen.is_some_and(|t| t.elapsed() >= yield_after) {
                return false;
            }
            drop(self.renew());
            true
        };
        while_renewing("guestmem-gc-mark", every, renew, work)
    }

    /// Whether the mark was never left unwritten for longer than [`LEASE_HELD`], up to
    /// now: else a push may have taken it for a dead gc's and skipped frames this gc would
    /// delete, and nothing more may be deleted.
    pub(super) fn check_held(&self) -> Result<(), StoreError> {
        let h = self.held();
        let gap = h.longest_gap.max(h.written.elapsed());
        if gap > LEASE_HELD {
            return Err(StoreError::Request {
                op: "gc",
                url: self.client.url(&self.key),
                reason: format!(
                    "gc's mark went {} s without a renewal the store took (limit {} s): a push \
                     may have gone on and skipped frames gc would delete, so nothing more was \
                     deleted; run gc again",
                    gap.as_secs(),
                    LEASE_HELD.as_secs()
                ),
                permanent: true,
            });
        }
        Ok(())
    }
}

impl Drop for GcMark<'_> {
    fn drop(&mut self) {
        // Best effort: a mark left behind goes stale, and holds pushes off until then.
        let _ = self.client.delete(&self.key);
    }
}

/// Runs `work` on this thread while a thread of its own (named `name`) calls `renew` every
/// `every`, until `work` returns or `renew` says to stop.
fn while_renewing<T>(
    name: &str,
    every: Duration,
    renew: impl Fn() -> bool + Send,
    work: impl FnOnce() -> T,
) -> T {
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let renewer = std::thread::Builder::new()
            .name(name.into())
            .spawn_scoped(s, move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(every)
                {
                    if !renew() {
                        break;
                    }
                }
            });
        let out = work();
        drop(stop);
        if let Ok(r) = renewer {
            let _ = r.join();
        }
        out
    })
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// A push's lease in the bucket: `gc` deletes nothing while one younger than
/// [`LEASE_STALE`] is there. Deleted when dropped.
pub(super) struct Lease {
    client: Arc<Client>,
    key: String,
    body: Bytes,
    held: Mutex<Held>,
}

/// What this host knows of its lease's age (its own monotonic clock; the store's may run
/// at another rate, hence [`LEASE_HELD`]'s margin).
struct Held {
    /// When the last renewal was tried.
    tried: Boot,
    /// When the last write that the store took was sent: the lease is at least this old.
    written: Boot,
    /// The longest time between two writes the store took: past [`LEASE_HELD`], a gc may
    /// have taken the lease for a dead push's in between.
    longest_gap: Duration,
}

/// The longest gap between two writes of a lease that a push trusts: half of
/// [`LEASE_STALE`], a margin for the store's clock, its write delays and a host clock
/// that runs slow.
pub(super) const LEASE_HELD: Duration = Duration::from_secs(LEASE_STALE.as_secs() / 2);

impl Lease {
    pub(super) fn take(client: &Arc<Client>, url: &StoreUrl) -> Result<Lease, StoreError> {
        let key = format!(
            "{LEASES}{}.{}.{}",
            url.name.replace('/', "_"),
            std::process::id(),
            nanos()
        );
        let body = Bytes::from(
            serde_json::json!({ "push": url.to_string(), "pid": std::process::id() }).to_string(),
        );
        let sent = Boot::now();
        client.put(&key, body.clone())?;
        Ok(Lease {
            client: Arc::clone(client),
            key,
            body,
            held: Mutex::new(Held {
                tried: sent,
                written: sent,
                longest_gap: Duration::ZERO,
            }),
        })
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes the lease again; notes the gap since the last write the store took.
    fn write(&self) -> Result<(), StoreError> {
        let sent = Boot::now();
        self.held().tried = sent;
        self.client.put(&self.key, self.body.clone())?;
        let mut h = self.held();
        h.longest_gap = h.longest_gap.max(sent.saturating_duration_since(h.written));
        h.written = h.written.max(sent);
        Ok(())
    }

    /// Writes the lease again if [`LEASE_RENEW`] has passed since the last try. A failure
    /// is left to [`Lease::confirm`], before the push publishes: one missed renewal of
    /// many does not let the lease go stale.
    pub(super) fn renew_if_due(&self) {
        if self.held().tried.elapsed() >= LEASE_RENEW {
            let _ = self.write();
        }
    }

    /// Runs `work` (the manifest's PUT, which a degraded store may take minutes over, its
    /// tries and their retries) while a thread renews the lease when due.
    pub(super) fn renewed_while<T>(&self, work: impl FnOnce() -> T) -> T {
        while_renewing(
            "guestmem-lease",
            Duration::from_secs(5),
            || {
                self.renew_if_due();
                true
            },
            work,
        )
    }

    /// The longest time the lease went unwritten, up to now.
    pub(super) fn longest_gap(&self) -> Duration {
        let h = self.held();
        h.longest_gap.max(h.written.elapsed())
    }

    /// Writes the lease once more, and checks that it was never left unwritten for longer
    /// than [`LEASE_HELD`] since it was taken: else a gc may have taken it for a dead
    /// push's and deleted frames this push uploaded or skipped, and the manifest must not
    /// be published. Called just before the manifest's PUT.
    pub(super) fn confirm(&self) -> Result<(), StoreError> {
        self.write()?;
        let gap = self.held().longest_gap;
        if gap > LEASE_HELD {
            return Err(StoreError::Request {
                op: "push",
                url: self.client.url(&self.key),
                reason: format!(
                    "the push's lease went {} s without a renewal the store took (limit {} s): \
                     a gc may have deleted frames it names, so nothing was published; push \
                     again (frames in the bucket are skipped)",
                    gap.as_secs(),
                    LEASE_HELD.as_secs()
                ),
                permanent: true,
            });
        }
        Ok(())
    }

    /// Waits while a gc runs (its mark younger than [`LEASE_STALE`] on the store's clock),
    /// writing this lease again each time it looks (the gc stops once it sees it, before
    /// its next batch of deletes). Called once the lease is written, before the push looks
    /// at any frame. Gives up when the mark has not gone within [`GC_WAIT`].
    /// `stop`, once set, ends the wait (the push's URL named).
    pub(super) fn wait_for_gc(
        &self,
        stop: Option<&std::sync::atomic::AtomicBool>,
        url: &StoreUrl,
    ) -> Result<(), StoreError> {
        let t0 = Instant::now();
        let stopped = || stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed));
        loop {
            let (now, listed) = store_now(&self.client, LEASES, &self.key)?;
            let gc = listed.iter().find(|l| {
                l.key.starts_with(GC_MARKS) && now - l.modified < LEASE_STALE.as_secs() as i64
            });
            let Some(gc) = gc else {
                return Ok(());
            };
            if t0.elapsed() > GC_WAIT {
                return Err(StoreError::Request {
                    op: "push",
                    url: self.client.url(&gc.key),
                    reason: format!(
                        "a gc's mark was still written {} minutes after this push began \
                         waiting for it (a gc renews it for {} s once it sees a push)",
                        GC_WAIT.as_secs() / 60,
                        GC_YIELD.as_secs()
                    ),
                    permanent: true,
                });
            }
            // In slices: a push asked to stop does not wait out the poll.
            let slept = Instant::now();
            while slept.elapsed() < GC_POLL {
                if stopped() {
                    return Err(StoreError::Stopped {
                        op: "push (waiting for a gc to end)",
                        url: url.to_string(),
                    });
                }
                std::thread::sleep(Duration::from_millis(100).min(GC_POLL));
            }
            self.write()?;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Best effort: a lease left behind goes stale.
        let _ = self.client.delete(&self.key);
    }
}

/// Checks, before anything depends on it, that a push to `url` can be written: the name
/// is free, and this client may write the bucket (a lease written and removed).
pub fn check_push(client: &Arc<Client>, url: &StoreUrl) -> Result<(), StoreError> {
    if client.get(&url.manifest_key())?.is_some() {
        return Err(StoreError::Exists {
            url: url.to_string(),
        });
    }
    drop(Lease::take(client, url)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use guestmem_testkit::s3::S3Server;

    use super::{Boot, GcMark, Lease, LEASE_HELD};
    use crate::store::{Client, StoreUrl};

    /// A lease left unwritten for longer than [`LEASE_HELD`] (a gc may have taken it for a
    /// dead push's meanwhile) fails its confirmation, naming the gap and the limit, even
    /// though it was written again since; a lease written in time passes; a dropped lease
    /// is gone from the bucket.
    #[test]
    fn a_lease_that_went_unwritten_too_long_is_not_confirmed() {
        let s3 = S3Server::start("lease-gap", &["snaps"]);
        let env = s3.env();
        let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        let c = Arc::new(Client::connect_with("snaps", &get).unwrap());
        let url = StoreUrl::parse("s3://snaps/vm", false).unwrap();

        let fresh = Lease::take(&c, &url).unwrap();
        fresh.renew_if_due();
        fresh.confirm().unwrap();
        drop(fresh);
        assert!(
            c.list("leases/").unwrap().is_empty(),
            "a dropped lease left"
        );

        let lapsed = Lease::take(&c, &url).unwrap();
        {
            let gap = LEASE_HELD + Duration::from_secs(60);
            let mut h = lapsed.held();
            match Boot::now().checked_sub(gap) {
                Some(then) => h.written = then,
                // A host up for less than the gap: the same as a renewal that came late.
                None => h.longest_gap = gap,
            }
        }
        // Written again since: the gap before stays.
        let _ = lapsed.write();
        let e = lapsed.confirm().unwrap_err().to_string();
        assert!(
            e.contains("without a renewal") && e.contains("limit 300 s") && e.contains("leases/"),
            "{e}"
        );
        drop(lapsed);
        assert!(
            c.list("leases/").unwrap().is_empty(),
            "a dropped lease left"
        );
    }

    /// A gc's mark left unwritten for longer than [`LEASE_HELD`] (a push may have taken it
    /// for a dead gc's and skipped frames meanwhile) stops the deletes, naming the gap and
    /// the limit, though written again since; the renewing thread ends with the work.
    #[test]
    fn a_gc_mark_left_unwritten_too_long_stops_the_deletes() {
        let s3 = S3Server::start("gc-mark-gap", &["snaps"]);
        let env = s3.env();
        let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        let c = Client::connect_with("snaps", &get).unwrap();
        let (mark, _, _) = GcMark::take(&c).unwrap();
        assert!(mark.renewed_while(|| mark.check_held().is_ok()));
        {
            let gap = LEASE_HELD + Duration::from_secs(60);
            let mut h = mark.held();
            match Boot::now().checked_sub(gap) {
                Some(then) => h.written = then,
                None => h.longest_gap = gap,
            }
        }
        let e = mark.check_held().unwrap_err().to_string();
        assert!(
            e.contains("without a renewal") && e.contains("limit 300 s"),
            "{e}"
        );
        mark.renew().unwrap();
        assert!(mark.check_held().is_err(), "the gap stays known");
        drop(mark);
        assert!(c.list("leases/").unwrap().is_empty(), "a mark left");
    }

    /// A gc held up after it saw a push (its work does not return) stops renewing its mark
    /// once the yield has passed, so that the mark goes stale and the push goes on; until
    /// then it renews.
    #[test]
    fn a_held_up_gc_stops_renewing_its_mark_once_it_has_seen_a_push() {
        let s3 = S3Server::start("gc-yield", &["snaps"]);
        let env = s3.env();
        let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        let c = Arc::new(Client::connect_with("snaps", &get).unwrap());
        let url = StoreUrl::parse("s3://snaps/vm", false).unwrap();
        let push = Lease::take(&c, &url).unwrap();
        let (mark, _, _) = GcMark::take(&c).unwrap();
        assert!(mark.push_seen());
        let every = Duration::from_millis(100);
        let yield_after = Duration::from_secs(2);
        let written = || mark.held().written;
        let first = written();
        // The work stands for a gc held up in a request: it returns well after the yield
        // (a renewal under way then has had 2 s to end), with the last write it saw.
        let quiet = mark.renewed_every(every, yield_after, || {
            std::thread::sleep(yield_after + Duration::from_secs(2));
            written()
        });
        assert!(quiet > first, "the mark was not renewed before the yield");
        // Renewals stopped at the yield, not when the work ended (a renewal's time is
        // when it was sent).
        assert!(
            quiet.0 + Duration::from_millis(1500) < Boot::now().0,
            "renewed until the work ended: no yield"
        );
        drop(mark);
        drop(push);
    }
}
