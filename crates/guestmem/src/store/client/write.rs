//! Writes to a bucket: an object in one PUT or in parts, a manifest only where none is
//! (a conditional PUT, sent again while no answer comes), and deletes.

use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};

use super::{capped, Capped, Client, MULTIPART_BYTES};
use crate::store::StoreError;

/// Times [`Client::put_new`] sends its PUT at most.
const PUT_NEW_TRIES: u32 = 4;

impl Client {
    /// Writes `bytes` at `key` (in parts past [`MULTIPART_BYTES`]).
    pub(crate) async fn put_async(&self, key: &str, bytes: Bytes) -> Result<(), StoreError> {
        let path = ObjectPath::from(key);
        if bytes.len() <= MULTIPART_BYTES {
            return self
                .store
                .put(&path, PutPayload::from(bytes))
                .await
                .map(|_| ())
                .map_err(|e| self.error("PUT", key, e));
        }
        let mut up = self
            .store
            .put_multipart(&path)
            .await
            .map_err(|e| self.error("start a multipart upload of", key, e))?;
        let mut parts = Vec::new();
        for at in (0..bytes.len()).step_by(MULTIPART_BYTES) {
            let part = bytes.slice(at..(at + MULTIPART_BYTES).min(bytes.len()));
            parts.push(up.put_part(PutPayload::from(part)));
        }
        let r = futures::future::try_join_all(parts).await;
        match r {
            Ok(_) => match up.complete().await {
                Ok(_) => Ok(()),
                Err(e) => {
                    // Its parts are stored, and billed, until aborted (a listing shows no
                    // object, so gc would never find them). An upload that did complete,
                    // its answer lost, is no longer there to abort: the object stays.
                    let _ = up.abort().await;
                    Err(self.error("complete the multipart upload of", key, e))
                }
            },
            Err(e) => {
                let _ = up.abort().await;
                Err(self.error("upload a part of", key, e))
            }
        }
    }

    /// [`Client::put_async`], from a plain thread.
    pub fn put(&self, key: &str, bytes: Bytes) -> Result<(), StoreError> {
        self.block_on(self.put_async(key, bytes))
    }

    /// Writes `bytes` at `key` only if no object is there, in one PUT the store decides
    /// (`If-None-Match: *`): false if one is, and it is not these bytes. A look before a
    /// write leaves a moment in which another writer's object can land and be replaced;
    /// this leaves none. An object there that holds these very bytes counts as written (a
    /// PUT that reached the store and lost its answer is sent again, and refused).
    ///
    /// The client retries a conditional PUT only on a few answers, not on a timeout: one
    /// that got no answer (or whose look after a refusal got none) is sent again here, up
    /// to [`PUT_NEW_TRIES`] times, as one refused for a conflict (another conditional write
    /// in flight, answered 409) is; any other answer is final. A store that does
    /// not take the condition is told so by the operator (`AWS_CONDITIONAL_PUT=disabled`,
    /// object_store's setting): the PUT is then plain, after the caller's look.
    pub(crate) fn put_new(&self, key: &str, bytes: Bytes) -> Result<bool, StoreError> {
        let path = ObjectPath::from(key);
        let mut tries = 0;
        loop {
            tries += 1;
            let opts = PutOptions {
                mode: PutMode::Create,
                ..PutOptions::default()
            };
            let payload = PutPayload::from(bytes.clone());
            let e = match self.block_on(self.store.put_opts(&path, payload, opts)) {
                Ok(_) => return Ok(true),
                Err(object_store::Error::NotImplemented { .. }) => {
                    return self.put(key, bytes).map(|()| true);
                }
                Err(object_store::Error::AlreadyExists { .. }) => {
                    let cap = bytes.len() as u64;
                    match self.block_on(capped(&*self.store, key, cap)) {
                        Ok(Some((there, _))) => return Ok(there == bytes),
                        // Longer than these bytes: another object.
                        Err(Capped::TooBig(_)) => return Ok(false),
                        // The look failed on the way: the PUT (conditional) is sent again.
                        Err(Capped::Store(e)) if transport(&e) => Some(e),
                        Err(e) => return Err(self.capped_error(key, cap, e)),
                        // Refused for a write in flight that has not landed (or was a
                        // delete): asked again.
                        Ok(None) => None,
                    }
                }
                // Sent again only when the store's answer never came (the client retried
                // every answer worth it already).
                Err(e) if transport(&e) => Some(e),
                Err(e) => return Err(self.error("PUT (only if none is there)", key, e)),
            };
            if tries >= PUT_NEW_TRIES {
                // One last look: a try whose answer was lost may have landed (the push is
                // then published; an error would say otherwise, and a push again would
                // find the name taken).
                let cap = bytes.len() as u64;
                if let Ok(Some((there, _))) = self.block_on(capped(&*self.store, key, cap)) {
                    if there == bytes {
                        return Ok(true);
                    }
                }
                return Err(match e {
                    Some(e) => self.error("PUT (only if none is there)", key, e),
                    None => StoreError::Request {
                        op: "PUT (only if none is there)",
                        url: self.url(key),
                        reason: format!(
                            "refused {PUT_NEW_TRIES} times for a write in flight that never landed"
                        ),
                        permanent: false,
                    },
                });
            }
            std::thread::sleep(Duration::from_millis(200 << tries.min(4)));
        }
    }

    /// Deletes `key` (not there already is no error).
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        match self.block_on(self.store.delete(&ObjectPath::from(key))) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error("DELETE", key, e)),
        }
    }
}

/// Whether `e` is a request that got no answer from the store (no connection, cut off, timed
/// out), not an answer: object_store's `HttpError` somewhere in its sources.
fn transport(e: &object_store::Error) -> bool {
    let mut at: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(x) = at {
        if x.downcast_ref::<object_store::client::HttpError>()
            .is_some()
        {
            return true;
        }
        at = x.source();
    }
    false
}
