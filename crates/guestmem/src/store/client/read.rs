//! Reading the store: an object whole and capped as its body comes, a listing a page at a
//! time, a look at whether an object is there, and the check a client makes before a VM
//! is served.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};

use super::{Client, Listed, IDLE_PER_HOST};
use crate::store::manifest::MAX_MANIFEST_BYTES;
use crate::store::StoreError;

impl Client {
    /// The whole object at `key` (a manifest, a lease), or `None` when there is none; one
    /// past [`MAX_MANIFEST_BYTES`] is refused before its body is read (whoever can write
    /// the bucket cannot make a reader hold more).
    pub fn get(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.block_on(self.get_async(key))
    }

    /// [`Client::get`] of a key as a listing gave it ([`Client::list`]): asked for as the
    /// store spells it, not escaped again (`Client::get` escapes what object_store's paths
    /// may not hold, `~` `%` `#` `[` and others, so a name another tool wrote with one was
    /// not found).
    pub fn get_listed(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        let path = ObjectPath::parse(key).map_err(|e| StoreError::Request {
            op: "GET",
            url: self.url(key),
            reason: format!("a listed key this client cannot ask for: {e}"),
            permanent: true,
        })?;
        let got = self.block_on(capped_at(&*self.store, &path, MAX_MANIFEST_BYTES));
        Ok(got
            .map_err(|e| self.capped_error(key, MAX_MANIFEST_BYTES, e))?
            .map(|(b, _)| b))
    }

    /// [`Client::get`], on the runtime.
    pub(crate) async fn get_async(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        Ok(self
            .get_capped(key, MAX_MANIFEST_BYTES)
            .await?
            .map(|(b, _)| b))
    }

    /// The object at `key` if it is at most `max` bytes (its length is checked before its
    /// body is read: a store or a move's source cannot make this read more), with how long
    /// its answer's first byte took; `None` when there is none.
    pub(crate) async fn get_capped(
        &self,
        key: &str,
        max: u64,
    ) -> Result<Option<(Bytes, Duration)>, StoreError> {
        let got = capped(&*self.store, key, max).await;
        got.map_err(|e| self.capped_error(key, max, e))
    }

    pub(super) fn capped_error(&self, key: &str, max: u64, e: Capped) -> StoreError {
        match e {
            Capped::Store(e) => self.error("GET", key, e),
            Capped::TooBig(n) => StoreError::Request {
                op: "GET",
                url: self.url(key),
                reason: format!("at least {n} bytes, past the {max} it can take"),
                permanent: true,
            },
        }
    }

    /// Opens up to `n` connections to the store before the GETs that will want them: `n`
    /// HEADs of `key` at once, each connection left idle in the pool once answered (for
    /// as long as the pool keeps an idle one). A VM's first read-ahead asks for dozens of
    /// frames at once; without this each went on a connection of its own made then (over
    /// TLS, a round trip or two more before its request). Waits at most `within`: what is
    /// not answered by then is dropped, and errors are left to the GETs that come later.
    ///
    /// The fault lane's pool ([`Lane`]) is warmed alongside with [`LANE_WARM`] connections,
    /// for a VM's first faults.
    pub(crate) fn warm(&self, key: &str, n: usize, within: Duration) {
        let until = tokio::time::Instant::now() + within;
        let lane = self.warm_lane(key, until);
        self.block_on(async {
            let path = ObjectPath::from(key);
            let n = n.min(IDLE_PER_HOST);
            let heads = futures::future::join_all((0..n).map(|_| self.store.head(&path)));
            let _ = tokio::time::timeout_at(until, heads).await;
            if let Some(lane) = lane {
                let _ = tokio::time::timeout_at(until, lane).await;
            }
        })
    }

    /// Whether `key` is there.
    pub(crate) async fn exists_async(&self, key: &str) -> Result<bool, StoreError> {
        match self.store.head(&ObjectPath::from(key)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.error("HEAD", key, e)),
        }
    }

    /// Every object whose key starts with `prefix` (a folder: ends with `/`).
    pub fn list(&self, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        let mut out = Vec::new();
        self.list_each(prefix, &mut |l| {
            out.push(l);
            true
        })?;
        Ok(out)
    }

    /// [`Client::list`], each object handed to `f` as its page of the listing comes, until
    /// `f` says false (then `Ok(false)`): a bucket of a million frames is neither held
    /// whole nor waited for whole.
    pub(crate) fn list_each(
        &self,
        prefix: &str,
        f: &mut dyn FnMut(Listed) -> bool,
    ) -> Result<bool, StoreError> {
        self.block_on(async {
            let p = ObjectPath::from(prefix.trim_end_matches('/'));
            let mut s = self.store.list(Some(&p));
            while let Some(m) = s.next().await {
                let m: ObjectMeta = m.map_err(|e| self.error("LIST", prefix, e))?;
                let go_on = f(Listed {
                    key: m.location.to_string(),
                    size: m.size,
                    modified: m.last_modified.timestamp(),
                });
                if !go_on {
                    return Ok(false);
                }
            }
            Ok(true)
        })
    }

    /// Checks the bucket answers and lets us read it (one listing of the snapshots): wrong
    /// credentials, a bucket not there, or an endpoint that does not answer are found here,
    /// before anything depends on them.
    pub fn check(&self) -> Result<(), StoreError> {
        self.block_on(async {
            let p = ObjectPath::from(crate::store::url::SNAPSHOTS.trim_end_matches('/'));
            let r = tokio::time::timeout(
                Duration::from_secs(30),
                self.store.list_with_delimiter(Some(&p)),
            )
            .await;
            match r {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(self.error("LIST", crate::store::url::SNAPSHOTS, e)),
                Err(_) => Err(StoreError::Request {
                    op: "LIST",
                    url: self.url(crate::store::url::SNAPSHOTS),
                    reason: format!("no answer from {} within 30 s", self.endpoint),
                    permanent: false,
                }),
            }
        })
    }
}

/// Why a capped GET gave nothing.
pub(super) enum Capped {
    Store(object_store::Error),
    /// The object's length, past what was asked for.
    TooBig(u64),
}

/// The object at `key` in `store` if it is at most `max` bytes, with how long its first
/// byte took: [`Client::get_capped`] on any store.
pub(super) async fn capped(
    store: &dyn ObjectStore,
    key: &str,
    max: u64,
) -> Result<Option<(Bytes, Duration)>, Capped> {
    capped_at(store, &ObjectPath::from(key), max).await
}

/// [`capped`] of an object named by its path as the store spells it.
async fn capped_at(
    store: &dyn ObjectStore,
    path: &ObjectPath,
    max: u64,
) -> Result<Option<(Bytes, Duration)>, Capped> {
    let sent = std::time::Instant::now();
    let r = match store.get(path).await {
        Ok(r) => r,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(Capped::Store(e)),
    };
    if r.meta.size > max {
        return Err(Capped::TooBig(r.meta.size));
    }
    let first_byte = sent.elapsed();
    // Counted as it comes, not trusted to its Content-Length: a chunked answer (whose
    // length hyper does not hold it to) could otherwise send on until memory ran out, its
    // size checked only once all of it was in.
    let hint = r.meta.size.min(max);
    let mut body = r.into_stream();
    let too_big = |n: usize| Capped::TooBig(n as u64);
    let first = match body.next().await {
        None => return Ok(Some((Bytes::new(), first_byte))),
        Some(c) => c.map_err(Capped::Store)?,
    };
    if first.len() as u64 > max {
        return Err(too_big(first.len()));
    }
    let Some(second) = body.next().await else {
        // The whole body in one piece: kept as it is.
        return Ok(Some((first, first_byte)));
    };
    let mut all = bytes::BytesMut::with_capacity(hint as usize);
    all.extend_from_slice(&first);
    let mut next = Some(second);
    while let Some(c) = next {
        let c = c.map_err(Capped::Store)?;
        if (all.len() + c.len()) as u64 > max {
            return Err(too_big(all.len() + c.len()));
        }
        all.extend_from_slice(&c);
        next = body.next().await;
    }
    Ok(Some((all.freeze(), first_byte)))
}
