//! The object store as the commands reach it: one client per bucket, one frame cache for
//! the host, shared by every snapshot served.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use guestmem::serve::MemoryFile;
use guestmem::store::{Client, FetchPolicy, FrameCache, Frames, StoreMemory, StoreUrl};

/// The buckets a command reads, and the host's frame cache.
pub struct Stores {
    cache: Option<Arc<FrameCache>>,
    policy: FetchPolicy,
    frames: HashMap<String, Arc<Frames>>,
}

impl Stores {
    /// Frames kept in `cache_dir` (at most `cache_size` bytes, else [`cache_bound`]'s),
    /// when given; fetches give up
    /// after `deadline`.
    pub fn new(
        cache_dir: Option<&Path>,
        cache_size: Option<u64>,
        deadline: Duration,
    ) -> Result<Stores> {
        let cache = match cache_dir {
            Some(d) => FrameCache::open_or_none(d, cache_bound(d, cache_size))
                .with_context(|| format!("--cache-dir {}", d.display()))?
                .map(Arc::new),
            None => None,
        };
        Ok(Stores {
            cache,
            policy: FetchPolicy {
                deadline,
                ..FetchPolicy::default()
            },
            frames: HashMap::new(),
        })
    }

    /// The frames of `bucket` (its client made on first use).
    pub fn frames(&mut self, bucket: &str) -> Result<Arc<Frames>> {
        if let Some(f) = self.frames.get(bucket) {
            return Ok(Arc::clone(f));
        }
        let client = Arc::new(Client::connect(bucket)?);
        let f = Frames::new(client, self.cache.clone(), self.policy);
        self.frames.insert(bucket.into(), Arc::clone(&f));
        Ok(f)
    }

    /// The snapshot at `url`, opened for serving: refused here (bucket, credentials,
    /// manifest) before any VM is served.
    pub fn open_memory(&mut self, url: &str) -> Result<StoreMemory> {
        let u = StoreUrl::parse(url, false)?;
        let frames = self.frames(&u.bucket)?;
        Ok(StoreMemory::open(frames, &u)?)
    }

    /// [`Stores::open_memory`], as a memory file for the page server.
    pub fn open(&mut self, url: &str) -> Result<MemoryFile> {
        Ok(MemoryFile::from_store(self.open_memory(url)?))
    }
}

/// A cache's bound where `--cache-size` is not given: the one its folder was last opened
/// with (a `move-in` beside a server keeps the server's), else 16 GiB. One recorded below
/// [`MIN_CACHE_BYTES`] (a library caller's) is not taken.
pub fn cache_bound(dir: &Path, given: Option<u64>) -> u64 {
    given
        .or_else(|| FrameCache::recorded_bound(dir).filter(|&b| b >= MIN_CACHE_BYTES))
        .unwrap_or(DEFAULT_CACHE_BYTES)
}

/// The smallest `--cache-size`: a bound takes effect on every process over the folder (the
/// smaller wins while they run, and it is recorded for the next), so a slip such as
/// `--cache-size 16` (bytes) would empty a host's cache and cache nothing.
const MIN_CACHE_BYTES: u64 = 64 << 20;

/// `--cache-size`: a size of at least 64M.
pub fn cache_size(s: &str) -> Result<u64, String> {
    let v = guestmem::plan::parse_size(s).map_err(|e| e.to_string())?;
    if v < MIN_CACHE_BYTES {
        return Err(format!(
            "{s:?} is {v} bytes: a frame cache is at least 64M (a size without a suffix is bytes)"
        ));
    }
    Ok(v)
}

/// The bound of a cache folder given none and saying none.
const DEFAULT_CACHE_BYTES: u64 = 16 << 30;
