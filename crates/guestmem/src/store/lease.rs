//! A push's lease in the bucket (`leases/`): written when a push starts, renewed while it
//! runs, deleted when it ends; `gc` deletes nothing while one younger than [`LEASE_STALE`]
//! is there.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::client::Client;
use super::url::{StoreUrl, LEASES};
use super::StoreError;

/// How long a push's lease stays good without being renewed; gc treats an older one as a
/// push that died.
pub const LEASE_STALE: Duration = Duration::from_secs(600);
/// How often a running push renews its lease.
pub(super) const LEASE_RENEW: Duration = Duration::from_secs(60);

/// A push's lease in the bucket: `gc` deletes nothing while one younger than
/// [`LEASE_STALE`] is there.
pub(super) struct Lease {
    client: Arc<Client>,
    key: String,
    body: Bytes,
    renewed: Mutex<Instant>,
}

impl Lease {
    pub(super) fn take(client: &Arc<Client>, url: &StoreUrl) -> Result<Lease, StoreError> {
        let key = format!(
            "{LEASES}{}.{}.{}",
            url.name.replace('/', "_"),
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        let body = Bytes::from(
            serde_json::json!({ "push": url.to_string(), "pid": std::process::id() }).to_string(),
        );
        client.put(&key, body.clone())?;
        Ok(Lease {
            client: Arc::clone(client),
            key,
            body,
            renewed: Mutex::new(Instant::now()),
        })
    }

    pub(super) fn renew_if_due(&self) {
        let mut at = self.renewed.lock().unwrap_or_else(|e| e.into_inner());
        if at.elapsed() >= LEASE_RENEW {
            *at = Instant::now();
            // A failed renewal shows in gc's refusal to trust a stale lease: the push's own
            // last check (the frames it skipped, looked at again) covers it.
            let _ = self.client.put(&self.key, self.body.clone());
        }
    }

    pub(super) fn release(&self) {
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
    Lease::take(client, url)?.release();
    Ok(())
}
