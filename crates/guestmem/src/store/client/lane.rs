//! The fault lane: a fault's own GETs to the store on a connection pool and a runtime of
//! their own ([`Lane`]), built on first use from the client's builder.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

use super::{capped, runtime, Client, Rt, LANE_WARM, RUNTIME_THREADS};
use crate::store::StoreError;

/// A fault's own GETs to the store, on a pool of connections and a runtime of their own.
/// Read-ahead may have dozens of GETs in flight, whose bodies keep the client's runtime
/// threads busy; a fault's GET sent there waits its turn behind them, though it is the one
/// a vCPU waits for. On a lane of its own it does not: on this project's 2-CPU host, a cold
/// cache's demand-miss p99 at 0 ms first byte went from 9.7-17.4 ms to 6.5-11.0 ms, and a
/// working set read by faults alone took 0.81-1.21 s instead of 0.93-1.53 s (BENCHMARKS.md,
/// "Object storage"). The same endpoint and credentials, the same S3 GETs; as many threads
/// as the client's runtime (one measured the same). Built when a snapshot is opened
/// ([`Client::warm`]) or at the first fault, not for a push or a listing.
///
/// A fault's GET keeps its attempt's time limit, and its retry's backoff, on the lane's
/// timer too: the client's runtime, busy with read-ahead, would fire them late.
pub(super) struct Lane {
    store: Arc<dyn ObjectStore>,
    rt: Rt,
}

impl Client {
    /// The fault lane, built on first use (a store's client only; none if its runtime
    /// cannot start, and a fault's GET then goes as any other).
    fn lane(&self) -> Option<&Lane> {
        self.lane
            .get_or_init(|| {
                // Built apart from the client's, the lane's store has a pool of its own.
                let store = self.lane_from.clone()?.build().ok()?;
                let rt = runtime(&self.bucket, RUNTIME_THREADS, "guestmem-s3-fault").ok()?;
                Some(Lane {
                    store: Arc::new(store),
                    rt: Rt(Some(rt)),
                })
            })
            .as_ref()
    }

    /// [`Client::get_capped`] for a fault's own GET, within `limit` (`Err(())`: no answer
    /// by then): on the fault lane where the client has one ([`Lane`]), timed there, else
    /// as any other. Dropped before its answer, the GET is dropped too.
    pub(crate) async fn get_fault(
        &self,
        key: &str,
        max: u64,
        limit: Duration,
    ) -> Result<Result<Option<(Bytes, Duration)>, StoreError>, ()> {
        let Some(lane) = self.lane() else {
            let got = tokio::time::timeout(limit, self.get_capped(key, max)).await;
            return got.map_err(|_| ());
        };
        let (store, k) = (Arc::clone(&lane.store), key.to_owned());
        let task = lane
            .rt
            .get()
            .spawn(async move { tokio::time::timeout(limit, capped(&*store, &k, max)).await });
        match Abort(task).await {
            Ok(Ok(got)) => Ok(got.map_err(|e| self.capped_error(key, max, e))),
            Ok(Err(_)) => Err(()),
            // The request panicked (its runtime is dropped only with the client): not tried
            // again.
            Err(e) => Ok(Err(StoreError::Request {
                op: "GET",
                url: self.url(key),
                reason: self.redact(format!("the fault lane's request ended: {e}")),
                permanent: true,
            })),
        }
    }

    /// Waits `d` before a fault's GET is tried again: on the fault lane's timer where there
    /// is one (the client's runtime, busy with read-ahead, would wake it late).
    pub(crate) async fn fault_backoff(&self, d: Duration) {
        match self.lane() {
            Some(lane) => {
                let _ = Abort(lane.rt.get().spawn(tokio::time::sleep(d))).await;
            }
            None => tokio::time::sleep(d).await,
        }
    }

    /// Opens [`LANE_WARM`] connections of the fault lane's pool, until `until` at most
    /// (HEADs of `key`): the task doing it, to wait for; none without a lane.
    pub(super) fn warm_lane(&self, key: &str, until: tokio::time::Instant) -> Option<Abort<()>> {
        let lane = self.lane()?;
        let (store, path) = (Arc::clone(&lane.store), ObjectPath::from(key));
        Some(Abort(lane.rt.get().spawn(async move {
            let heads = (0..LANE_WARM).map(|_| store.head(&path));
            let _ = tokio::time::timeout_at(until, futures::future::join_all(heads)).await;
        })))
    }
}

/// A task on another runtime, aborted when dropped before its end (a caller that stopped
/// waiting for it).
pub(super) struct Abort<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for Abort<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T> std::future::Future for Abort<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx)
    }
}
