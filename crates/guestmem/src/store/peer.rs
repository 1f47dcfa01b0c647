//! A move's source host, serving the frames of its diff to the destination over HTTP/1.1 in
//! the store's own layout (`frames/<hash>`, `snapshots/NAME/manifest.json`), read-only, so
//! that the destination reads them through the one fetch path it reads the store through
//! ([`super::Client::peer`], then [`super::Frames`]: flights, hash checks, retries, the
//! deadline). The objects are held in memory ([`super::Client::in_memory`]): the diff of one
//! VM, for as long as the move needs it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};

use super::client::Client;
use super::StoreError;

/// What the source host served.
#[derive(Debug, Default)]
pub struct PeerCounters {
    /// GETs answered with an object.
    pub gets: AtomicU64,
    /// Bytes of objects sent.
    pub bytes: AtomicU64,
    /// Requests for what it does not hold.
    pub not_found: AtomicU64,
}

/// Serves the objects of `objects` on a TCP address until dropped.
#[derive(Debug)]
pub struct PeerServer {
    addr: SocketAddr,
    rt: Option<tokio::runtime::Runtime>,
    /// Held here too, so that the last reference (and the client's own runtime) is never
    /// dropped inside this server's runtime, where dropping a runtime panics.
    _objects: Arc<Client>,
    /// What it served.
    pub counters: Arc<PeerCounters>,
}

impl PeerServer {
    /// Listens on `listen` (port 0: any) and serves `objects` from two threads of its own.
    pub fn start(listen: SocketAddr, objects: Arc<Client>) -> Result<PeerServer, StoreError> {
        let io = |op| {
            move |source| StoreError::Io {
                op,
                path: listen.to_string().into(),
                source,
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("guestmem-peer")
            .enable_all()
            .build()
            .map_err(io("start the runtime of the page source on"))?;
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(listen))
            .map_err(io("listen on"))?;
        let addr = listener.local_addr().map_err(io("read the address of"))?;
        let counters = Arc::new(PeerCounters::default());
        let c = Arc::clone(&counters);
        let held = Arc::clone(&objects);
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let (objects, c) = (Arc::clone(&objects), Arc::clone(&c));
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let (objects, c) = (Arc::clone(&objects), Arc::clone(&c));
                        async move { Ok::<_, Infallible>(answer(&objects, &c, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(PeerServer {
            addr,
            rt: Some(rt),
            _objects: held,
            counters,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Bytes of objects sent so far.
    pub fn bytes_sent(&self) -> u64 {
        self.counters.bytes.load(Ordering::Relaxed)
    }
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            // Waits for its threads (and the tasks they drop) before `_objects` goes.
            rt.shutdown_timeout(std::time::Duration::from_secs(5));
        }
    }
}

/// One request: GET or HEAD of a frame or a manifest this host holds; anything else is
/// refused.
async fn answer<B>(objects: &Client, c: &PeerCounters, req: Request<B>) -> Response<Full<Bytes>> {
    let status = |s: StatusCode| {
        let mut r = Response::new(Full::new(Bytes::new()));
        *r.status_mut() = s;
        r
    };
    let head = match *req.method() {
        Method::GET => false,
        Method::HEAD => true,
        _ => return status(StatusCode::METHOD_NOT_ALLOWED),
    };
    let key = req.uri().path().trim_start_matches('/');
    let known = [super::url::FRAMES, super::url::SNAPSHOTS]
        .iter()
        .any(|p| key.starts_with(p));
    if !known || key.contains("..") {
        c.not_found.fetch_add(1, Ordering::Relaxed);
        return status(StatusCode::NOT_FOUND);
    }
    match objects.get_async(key).await {
        Ok(Some(b)) => {
            let len = b.len();
            let mut r = if head {
                status(StatusCode::OK)
            } else {
                c.gets.fetch_add(1, Ordering::Relaxed);
                c.bytes.fetch_add(len as u64, Ordering::Relaxed);
                Response::new(Full::new(b))
            };
            r.headers_mut()
                .insert(hyper::header::CONTENT_LENGTH, len.into());
            r
        }
        Ok(None) => {
            c.not_found.fetch_add(1, Ordering::Relaxed);
            status(StatusCode::NOT_FOUND)
        }
        Err(_) => status(StatusCode::INTERNAL_SERVER_ERROR),
    }
}
