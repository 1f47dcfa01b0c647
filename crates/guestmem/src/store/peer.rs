//! A move's source host, serving the frames of its diff to the destination over HTTP/1.1 in
//! the store's own layout (`frames/<hash>`, `snapshots/NAME/manifest.json`), read-only, so
//! that the destination reads them through the one fetch path it reads the store through
//! ([`super::Client::peer`], then [`super::Frames`]: flights, hash checks, retries, the
//! deadline). The diff's frames are held where they lie in its file ([`HeldFrames`], read
//! when asked for), its manifest in memory ([`super::Client::in_memory`]): the diff of one
//! VM, for as long as the move needs it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};

use super::client::Client;
use super::held::HeldFrames;
use super::StoreError;

/// Connections served at once (a destination reads with tens; more wait to be accepted).
const MAX_CONNECTIONS: usize = 256;
/// How long a connection may go without a request's headers (idle, or sending them).
const IDLE_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a connection to a locked server may go before a request carrying its token:
/// one that sends nothing (or only a trickle of headers) holds one of the
/// [`MAX_CONNECTIONS`] places for this long, not for [`IDLE_LIMIT`]. The destination's
/// fault threads send their first request as soon as they connect; its runtime's pool may
/// keep a connection it opened and did not need, which is then closed here unused (a
/// request written to it as it closes fails before its answer and is sent again).
const FIRST_REQUEST_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A connection whose reader stops taking what is sent (its window shut, or its host gone)
/// is reset once data has waited this long to be taken (`TCP_USER_TIMEOUT`, with keepalive
/// probes of an idle one): a request's answer half written holds its place no longer.
#[cfg(not(test))]
const STALL: (std::time::Duration, std::time::Duration, u32) = (
    std::time::Duration::from_secs(10),
    std::time::Duration::from_secs(5),
    4,
);
#[cfg(test)]
const STALL: (std::time::Duration, std::time::Duration, u32) = (
    std::time::Duration::from_secs(1),
    std::time::Duration::from_secs(1),
    1,
);

/// What the source host served.
#[derive(Debug, Default)]
pub struct PeerCounters {
    /// GETs answered with an object.
    pub gets: AtomicU64,
    /// Bytes of objects sent.
    pub bytes: AtomicU64,
    /// Requests for what it does not hold.
    pub not_found: AtomicU64,
    /// Requests refused for not carrying the move's token (a locked server).
    pub refused: AtomicU64,
    /// Requests that failed here (a diff file that could not be read, the store behind
    /// it): answered 500 with the reason, and logged at most every 10 s.
    pub failed: AtomicU64,
    /// When a failure was last logged, seconds on a clock of this process (0: never).
    logged_at: AtomicU64,
}

/// What a locked server asks every request for ([`PeerServer::start_locked`]), and the key
/// it seals the pieces named later with: none answered before they are set. Its `Debug`
/// shows whether they are, never them.
#[derive(Clone, Default)]
struct Lock(Arc<std::sync::OnceLock<(String, [u8; 32])>>);

impl Lock {
    fn get(&self) -> Option<&(String, [u8; 32])> {
        self.0.get()
    }
}

impl std::fmt::Debug for Lock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.get() {
            Some(_) => "Lock(set)",
            None => "Lock(not yet)",
        })
    }
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
    lock: Option<Lock>,
}

impl PeerServer {
    /// Listens on `listen` (port 0: any) and serves `frames`, then `objects`, from two
    /// threads of its own.
    pub fn start(
        listen: SocketAddr,
        frames: Arc<HeldFrames>,
        objects: Arc<Client>,
    ) -> Result<PeerServer, StoreError> {
        PeerServer::serve(listen, frames, objects, None)
    }

    /// [`PeerServer::start`], answering no request until [`PeerServer::unlock`], and then
    /// only those that carry its token (`authorization: Guestmem TOKEN`): a move between
    /// hosts that hold a move key.
    pub(crate) fn start_locked(
        listen: SocketAddr,
        frames: Arc<HeldFrames>,
        objects: Arc<Client>,
    ) -> Result<PeerServer, StoreError> {
        PeerServer::serve(listen, frames, objects, Some(Lock::default()))
    }

    /// Answers, from now on, the requests that carry `token`, its pieces named later sealed
    /// with `seal` (a locked server; once).
    pub(crate) fn unlock(&self, token: String, seal: [u8; 32]) {
        if let Some(l) = &self.lock {
            let _ = l.0.set((token, seal));
        }
    }

    fn serve(
        listen: SocketAddr,
        frames: Arc<HeldFrames>,
        objects: Arc<Client>,
        lock: Option<Lock>,
    ) -> Result<PeerServer, StoreError> {
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
        let lock_kept = lock.clone();
        let held = Arc::clone(&objects);
        // At most this many connections at once; more wait in the listen backlog.
        let open = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        rt.spawn(async move {
            loop {
                let Ok(permit) = Arc::clone(&open).acquire_owned().await else {
                    return;
                };
                let stream = match listener.accept().await {
                    Ok((s, _)) => s,
                    Err(_) => {
                        // Out of descriptors, say: wait a little rather than spin.
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                {
                    use std::os::fd::AsFd;
                    // Best effort: without it, a reader that stops holds its place until
                    // it goes.
                    let _ = crate::sys::tcp_keepalive(stream.as_fd(), STALL.0, STALL.1, STALL.2);
                }
                let (frames, objects, c, lock) = (
                    Arc::clone(&frames),
                    Arc::clone(&objects),
                    Arc::clone(&c),
                    lock.clone(),
                );
                tokio::spawn(async move {
                    let locked = lock.is_some();
                    // Whether a request carrying the token came on this connection.
                    let proved = Arc::new(std::sync::atomic::AtomicBool::new(false));
                    let proved_in = Arc::clone(&proved);
                    let svc = hyper::service::service_fn(move |req| {
                        let (frames, objects, c) =
                            (Arc::clone(&frames), Arc::clone(&objects), Arc::clone(&c));
                        let allowed = lock.as_ref().is_none_or(|l| carries(&req, l));
                        if allowed {
                            proved_in.store(true, Ordering::Relaxed);
                        }
                        let seal = lock.as_ref().and_then(|l| l.get()).map(|(_, k)| *k);
                        async move {
                            Ok::<_, Infallible>(match allowed {
                                true => answer(&frames, &objects, &c, seal.as_ref(), req).await,
                                false => {
                                    c.refused.fetch_add(1, Ordering::Relaxed);
                                    // And closed: a connection without the token
                                    // holds none of the server's places.
                                    let mut r = Response::new(Full::new(Bytes::new()));
                                    *r.status_mut() = StatusCode::FORBIDDEN;
                                    r.headers_mut().insert(
                                        hyper::header::CONNECTION,
                                        hyper::header::HeaderValue::from_static("close"),
                                    );
                                    r
                                }
                            })
                        }
                    });
                    // A connection that sends no request for this long is closed, so an
                    // idle or half-open one does not hold its place for ever.
                    let conn = hyper::server::conn::http1::Builder::new()
                        .timer(hyper_util::rt::TokioTimer::new())
                        .header_read_timeout(IDLE_LIMIT)
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
                    tokio::pin!(conn);
                    let first = tokio::time::sleep(FIRST_REQUEST_LIMIT);
                    tokio::select! {
                        // The connection first: a request's head that came with the
                        // timer is read (and proves it) before the timer is looked at.
                        biased;
                        _ = &mut conn => {}
                        _ = first, if locked => {
                            // Dropped unproved: its socket is closed.
                            if proved.load(Ordering::Relaxed) {
                                let _ = conn.await;
                            }
                        }
                    }
                    drop(permit);
                });
            }
        });
        Ok(PeerServer {
            addr,
            rt: Some(rt),
            _objects: held,
            counters,
            lock: lock_kept,
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

/// Whether `req` carries the token `lock` holds (none set yet: no request does).
fn carries<B>(req: &Request<B>, lock: &Lock) -> bool {
    let Some((token, _)) = lock.get() else {
        return false;
    };
    let Some(got) = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Guestmem "))
    else {
        return false;
    };
    super::frame::same_bytes(got, token.as_bytes())
}

/// One request: GET or HEAD of a frame or a manifest this host holds; anything else is
/// refused.
async fn answer<B>(
    frames: &HeldFrames,
    objects: &Client,
    c: &PeerCounters,
    seal: Option<&[u8; 32]>,
    req: Request<B>,
) -> Response<Full<Bytes>> {
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
    // A HEAD of a held frame is answered from its length, not read.
    if let (true, Some(len)) = (
        head,
        key.strip_prefix(super::url::FRAMES)
            .and_then(|hex| frames.object_len(hex, seal.is_some())),
    ) {
        let mut r = status(StatusCode::OK);
        r.headers_mut()
            .insert(hyper::header::CONTENT_LENGTH, len.into());
        return r;
    }
    // A held frame is read from the diff file here (a read of tmpfs pages, microseconds).
    let held = match key.strip_prefix(super::url::FRAMES) {
        Some(hex) => frames.object(hex, seal),
        None => Ok(None),
    };
    let got = match held {
        Ok(Some(b)) => Ok(Some(b)),
        Ok(None) => objects.get_async(key).await,
        Err(e) => Err(e),
    };
    match got {
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
        Err(e) => {
            // Said on both hosts: here in the log, there in the answer's body (the fault
            // that asked retries to its deadline, then ends its VM with it).
            let n = c.failed.fetch_add(1, Ordering::Relaxed) + 1;
            static T0: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
            let now = T0.get_or_init(std::time::Instant::now).elapsed().as_secs() + 1;
            let last = c.logged_at.load(Ordering::Relaxed);
            if (last == 0 || now >= last + 10)
                && c.logged_at
                    .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                tracing::error!("move source: {key} could not be served ({n} failed so far): {e}");
            }
            let said: String = format!("the move's source could not serve {key}: {e}")
                .chars()
                .take(1024)
                .collect();
            let mut r = Response::new(Full::new(Bytes::from(said)));
            *r.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            r
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::store::fetch::{FetchPolicy, Frames};
    use crate::store::frame;
    use crate::store::url::frame_key;

    fn policy(deadline_ms: u64) -> FetchPolicy {
        FetchPolicy {
            deadline: Duration::from_millis(deadline_ms),
            attempt: Duration::from_millis(deadline_ms / 2),
            ahead_gets: 4,
            guess_gets: 4,
        }
    }

    fn plain(seed: u8) -> Vec<u8> {
        (0..64 << 10).map(|i| (i as u8) ^ seed).collect()
    }

    #[test]
    fn owed_frames_come_from_the_source_checked_then_from_the_store_once_released() {
        let store = Arc::new(Client::in_memory("store").unwrap());
        let held = Arc::new(Client::in_memory("source").unwrap());
        let p = plain(7);
        let hash = blake3::hash(&p);
        held.put(&frame_key(&hash), Bytes::from(frame::raw(&p)))
            .unwrap();
        let server = PeerServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(HeldFrames::new()),
            Arc::clone(&held),
        )
        .unwrap();
        let frames = Frames::new(Arc::clone(&store), None, policy(2000));
        let peer = Client::peer(&format!("http://{}", server.addr())).unwrap();
        frames.follow(Arc::new(peer), [hash]);
        assert!(frames.following());
        assert_eq!(*frames.get(&hash, p.len()).unwrap(), p);
        let c = &frames.counters;
        assert_eq!(c.peer_gets.load(Ordering::Relaxed), 1);
        assert_eq!(server.bytes_sent(), (p.len() + frame::HEADER_BYTES) as u64);
        // Released: the same frame now comes from the store (no cache: a GET again).
        store
            .put(&frame_key(&hash), Bytes::from(frame::raw(&p)))
            .unwrap();
        frames.release();
        assert!(!frames.following());
        assert_eq!(*frames.get(&hash, p.len()).unwrap(), p);
        assert_eq!(c.peer_gets.load(Ordering::Relaxed), 1);
        assert_eq!(c.gets.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_source_that_is_gone_fails_the_fetch_at_the_deadline_naming_it() {
        let store = Arc::new(Client::in_memory("store").unwrap());
        // A port nothing listens on: bound, then let go.
        let gone = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        // Through the runtime, and as a fault reads it, on its own thread.
        for here in [false, true] {
            let frames = Frames::new(Arc::clone(&store), None, policy(2000));
            let hash = blake3::hash(&plain(1));
            frames.follow(
                Arc::new(Client::peer(&format!("http://{gone}")).unwrap()),
                [hash],
            );
            let _here = here.then(crate::store::direct::read_here);
            let t = Instant::now();
            let e = frames.get(&hash, 64 << 10).unwrap_err().to_string();
            assert!(
                t.elapsed() >= Duration::from_millis(2000),
                "{:?}",
                t.elapsed()
            );
            assert!(e.contains(&format!("http://{gone}/frames/")), "{e}");
            assert!(
                frames.counters.errors.load(Ordering::Relaxed) >= 2,
                "retried: {e}"
            );
        }
    }

    #[test]
    fn a_source_serving_other_bytes_under_a_frame_fails_closed() {
        let store = Arc::new(Client::in_memory("store").unwrap());
        let held = Arc::new(Client::in_memory("source").unwrap());
        let (good, bad) = (plain(3), plain(4));
        let hash = blake3::hash(&good);
        held.put(&frame_key(&hash), Bytes::from(frame::raw(&bad)))
            .unwrap();
        let server = PeerServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(HeldFrames::new()),
            held,
        )
        .unwrap();
        let frames = Frames::new(store, None, policy(2000));
        let peer = Client::peer(&format!("http://{}", server.addr())).unwrap();
        frames.follow(Arc::new(peer), [hash]);
        let e = frames.get(&hash, good.len()).unwrap_err().to_string();
        assert!(e.contains("fetched twice"), "{e}");
        assert_eq!(frames.counters.mismatches.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn the_source_serves_only_frames_and_manifests_and_only_reads() {
        let held = Arc::new(Client::in_memory("source").unwrap());
        held.put("leases/x", Bytes::from_static(b"secret")).unwrap();
        let server = PeerServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(HeldFrames::new()),
            held,
        )
        .unwrap();
        let ask = |req: &str| {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(server.addr()).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(req.as_bytes()).unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        };
        let get = ask("GET /leases/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert!(get.starts_with("HTTP/1.1 404"), "{get}");
        let put = ask(
            "PUT /frames/x HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        );
        assert!(put.starts_with("HTTP/1.1 405"), "{put}");
        let up = ask("GET /frames/../leases/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        assert!(
            up.starts_with("HTTP/1.1 404") || up.starts_with("HTTP/1.1 400"),
            "{up}"
        );
    }

    /// A reader that sends requests and takes none of their answers holds its connection
    /// only until the answers have waited `STALL` to be taken: the connection is reset.
    /// Before, hyper's write waited for ever (its timer covers reading a request's head),
    /// and 256 such connections stopped the source serving anyone.
    #[test]
    fn a_reader_that_stops_taking_answers_is_let_go() {
        use std::io::{Read, Write};
        let held = Arc::new(Client::in_memory("source").unwrap());
        held.put(
            "snapshots/m/manifest.json",
            Bytes::from(vec![b' '; 64 << 10]),
        )
        .unwrap();
        let server = PeerServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(HeldFrames::new()),
            held,
        )
        .unwrap();
        let mut s = std::net::TcpStream::connect(server.addr()).unwrap();
        // 2,000 requests for 64 KiB each, far past what the sockets' buffers hold.
        let req = "GET /snapshots/m/manifest.json HTTP/1.1\r\nHost: x\r\n\r\n".repeat(2000);
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(req.as_bytes());
        let (idle, interval, probes) = STALL;
        std::thread::sleep(idle + interval * probes + Duration::from_secs(3));
        // What came is read; then the connection must be over, not waiting on the server.
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0usize;
        let end = loop {
            match s.read(&mut buf) {
                Ok(0) => break "closed",
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break "reset",
                Err(e) => panic!("the connection is still held after {got} bytes: {e}"),
            }
        };
        assert!(got < 2000 * (64 << 10), "{end} after all {got} bytes");
    }

    /// A locked source holding one manifest, `snapshots/m/manifest.json` (`{}`), not
    /// unlocked yet.
    fn locked_source() -> PeerServer {
        let held = Arc::new(Client::in_memory("source").unwrap());
        held.put("snapshots/m/manifest.json", Bytes::from_static(b"{}"))
            .unwrap();
        PeerServer::start_locked(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(HeldFrames::new()),
            held,
        )
        .unwrap()
    }

    /// A locked source (a move with a key) answers nothing before it learns the token,
    /// then only requests that carry it: through the runtime's client and the fault's own.
    #[test]
    fn a_locked_source_answers_only_requests_with_its_token() {
        let server = locked_source();
        let base = format!("http://{}", server.addr());
        let key = "snapshots/m/manifest.json";
        let token = "0123abcd".repeat(8);
        let open = Client::peer(&base).unwrap();
        let with = Client::peer_locked(&base, &token, [1; 32]).unwrap();
        let wrong = Client::peer_locked(&base, &"f".repeat(64), [1; 32]).unwrap();
        // Before the token is known: no one, not even a HEAD.
        assert!(with.get(key).is_err());
        assert!(with.block_on(with.exists_async(key)).is_err(), "a HEAD");
        server.unlock(token.clone(), [1; 32]);
        // Nothing of the token or the seal in its Debug.
        let shown = format!("{server:?}");
        assert!(
            !shown.contains(&token) && shown.contains("Lock(set)"),
            "{shown}"
        );
        let e = open.get(key).unwrap_err().to_string();
        assert!(e.contains("403") || e.contains("orbidden"), "{e}");
        // Refused, and the token it sent is in no error.
        let w = wrong.get(key).unwrap_err().to_string();
        assert!(!w.contains(&"f".repeat(64)), "{w}");
        assert_eq!(with.get(key).unwrap().as_deref(), Some(&b"{}"[..]));
        // The fault's own path sends it too; with another token it is refused for good.
        let other = "e".repeat(64);
        let d = super::super::direct::Direct::new(&base, Some(&other)).unwrap();
        assert!(!format!("{d:?}").contains(&other));
        let sent = d.send(key, 1 << 20, Duration::from_secs(5)).unwrap();
        assert!(!format!("{sent:?}").contains(&other));
        match d.receive(sent) {
            Err(super::super::direct::DirectError::Failed { reason, permanent }) => {
                assert!(permanent && reason.contains("403"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        let d = super::super::direct::Direct::new(&base, Some(&token)).unwrap();
        let sent = d.send(key, 1 << 20, Duration::from_secs(5)).unwrap();
        let got = d.receive(sent).unwrap().map(|(b, _)| b);
        assert_eq!(got.as_deref(), Some(&b"{}"[..]));
        assert!(server.counters.refused.load(Ordering::Relaxed) >= 3);
    }

    #[test]
    fn a_locked_source_closes_a_connection_that_sends_no_request_with_its_token() {
        use std::io::{Read, Write};
        let server = locked_source();
        let token = "0123abcd".repeat(8);
        server.unlock(token.clone(), [1; 32]);
        // Whether the server has closed `s`, looked at for `for_`.
        let closed = |s: &mut std::net::TcpStream, for_: Duration| -> bool {
            s.set_read_timeout(Some(for_)).unwrap();
            let mut b = [0u8; 1];
            !matches!(s.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut)
        };
        let t = std::time::Instant::now();
        let mut silent = std::net::TcpStream::connect(server.addr()).unwrap();
        // A trickle of a request, never finished.
        let mut trickle = std::net::TcpStream::connect(server.addr()).unwrap();
        trickle
            .write_all(b"GET /snapshots/m/manifest.json HTTP/1.1\r\nhost: x\r\n")
            .unwrap();
        let mut proved = std::net::TcpStream::connect(server.addr()).unwrap();
        write!(
            proved,
            "GET /snapshots/m/manifest.json HTTP/1.1\r\nhost: x\r\nauthorization: Guestmem {token}\r\n\r\n"
        )
        .unwrap();
        // Its whole answer: the head, then the manifest's two bytes.
        let mut answer = Vec::new();
        while !answer.ends_with(b"\r\n\r\n{}") {
            let mut b = [0u8; 512];
            let n = proved.read(&mut b).unwrap();
            assert!(n > 0, "closed after {answer:?}");
            answer.extend_from_slice(&b[..n]);
        }
        assert!(answer.starts_with(b"HTTP/1.1 200"));
        assert!(
            closed(&mut silent, Duration::from_secs(20)),
            "a silent connection kept"
        );
        assert!(
            closed(&mut trickle, Duration::from_secs(20)),
            "a trickling one kept"
        );
        assert!(t.elapsed() >= FIRST_REQUEST_LIMIT);
        assert!(
            t.elapsed() < IDLE_LIMIT,
            "closed only at the idle limit: {:?}",
            t.elapsed()
        );
        // The one that proved itself stays open, idle, past the first request's limit.
        assert!(
            !closed(&mut proved, Duration::from_millis(500)),
            "a proved connection closed"
        );
    }
}

#[cfg(test)]
pub(crate) mod held_tests {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use super::PeerServer;
    use crate::store::fetch::{FetchPolicy, Frames};
    use crate::store::{
        push, push_held, read_snapshot, Client, HeldFrames, PushConfig, PushSource, Snapshot,
        StoreMemory, StoreUrl,
    };

    pub(crate) const PAGE: u64 = 4096;
    pub(crate) const FB: u64 = 64 << 10;
    pub(crate) const MEM: u64 = 8 * FB;

    /// A scratch folder for a test that writes a diff and reads its holes, or `None` (the
    /// skip recorded) where the temporary folder's file system reports a sparse file's
    /// data coarser than pages, as a tmpfs with huge pages does.
    pub(crate) fn diff_scratch(name: &str) -> Option<guestmem_testkit::Scratch> {
        let scratch = guestmem_testkit::Scratch::new(name);
        match crate::store::check_diff_folder(&scratch) {
            Ok(()) => Some(scratch),
            Err(e) => {
                guestmem_testkit::skip(e);
                None
            }
        }
    }

    /// `bytes` pushed to an in-memory store as `s3://bkt/base`, in frames of FB.
    pub(crate) fn base_in_store(
        scratch: &std::path::Path,
        bytes: &[u8],
    ) -> (Arc<Client>, StoreUrl) {
        std::fs::write(scratch.join("base"), bytes).unwrap();
        let store = Arc::new(Client::in_memory("store").unwrap());
        let base = StoreUrl::parse("s3://bkt/base", false).unwrap();
        let cfg = PushConfig {
            frame_bytes: FB,
            threads: 2,
            ..PushConfig::default()
        };
        push(&store, &PushSource::Raw(scratch.join("base")), &base, &cfg).unwrap();
        (store, base)
    }

    /// A move's push of a raw diff on `base` (raw frames, nothing looked up first).
    /// The base's snapshot, read from `store` as a push reads it.
    pub(crate) fn read_base(store: &Arc<Client>, base: &StoreUrl) -> Snapshot {
        read_snapshot(
            &Frames::new(Arc::clone(store), None, FetchPolicy::default()),
            base,
        )
        .unwrap()
    }

    /// A push of the raw diff at `path` on `base` (read as `snap`) to `s3://bkt/diff`, which
    /// must be refused: the error's text, and nothing published.
    fn refused_diff(
        store: &Arc<Client>,
        base: &StoreUrl,
        snap: &Snapshot,
        path: &std::path::Path,
    ) -> String {
        let src = PushSource::RawDiff {
            path: path.to_path_buf(),
            base: base.clone(),
        };
        let to = StoreUrl::parse("s3://bkt/diff", false).unwrap();
        let e = push(store, &src, &to, &diff_config(store, snap.clone()))
            .unwrap_err()
            .to_string();
        assert!(
            store.get(&to.manifest_key()).unwrap().is_none(),
            "published: {e}"
        );
        e
    }

    pub(crate) fn diff_config(store: &Arc<Client>, base: Snapshot) -> PushConfig {
        PushConfig {
            frame_bytes: FB,
            threads: 2,
            compress: false,
            base_from: Some(Arc::clone(store)),
            base: Some(Arc::new(base)),
            look_first: false,
            reused_file_ok: false,
            stop: None,
        }
    }

    /// The base's bytes, and a diff on them at `path`: frame 0 whole, pages 1, 2 and 5 of
    /// frame 2, frame 5 whole and all zero, the last page; the rest holes. The memory the
    /// diff stands for.
    pub(crate) fn diff_on(base: &[u8], path: &std::path::Path) -> Vec<u8> {
        let f = std::fs::File::create(path).unwrap();
        f.set_len(MEM).unwrap();
        let mut want = base.to_vec();
        let mut write = |at: u64, b: Vec<u8>| {
            f.write_all_at(&b, at).unwrap();
            want[at as usize..at as usize + b.len()].copy_from_slice(&b);
        };
        write(0, (0..FB).map(|i| (i * 7 + 1) as u8).collect());
        for p in [1, 2, 5] {
            write(2 * FB + p * PAGE, vec![0xc0 | p as u8; PAGE as usize]);
        }
        write(5 * FB, vec![0; FB as usize]);
        write(MEM - PAGE, vec![0xee; PAGE as usize]);
        want
    }

    /// A base of given bytes in an in-memory store ([`base_in_store`]) and a diff on it
    /// ([`diff_on`]) at `scratch/diff`, the base's manifest read back.
    pub(in crate::store) struct BaseAndDiff {
        pub store: Arc<Client>,
        pub base: StoreUrl,
        pub snap: Snapshot,
        pub diff_path: std::path::PathBuf,
        /// The memory the diff stands for.
        pub want: Vec<u8>,
    }

    impl BaseAndDiff {
        pub fn new(scratch: &std::path::Path, base_bytes: &[u8]) -> BaseAndDiff {
            let (store, base) = base_in_store(scratch, base_bytes);
            let diff_path = scratch.join("diff");
            let want = diff_on(base_bytes, &diff_path);
            let snap = read_base(&store, &base);
            BaseAndDiff {
                store,
                base,
                snap,
                diff_path,
                want,
            }
        }

        /// The hashes of the base's pieces.
        pub fn in_base(&self) -> std::collections::HashSet<blake3::Hash> {
            self.snap.frames.iter().flatten().map(|p| p.hash).collect()
        }

        /// The diff cut as a move's source holds it ([`push_held`], as `s3://bkt/diff`).
        pub fn held(&self) -> HeldDiff {
            let diff = StoreUrl::parse("s3://bkt/diff", false).unwrap();
            let cfg = diff_config(&self.store, self.snap.clone());
            let src = PushSource::RawDiff {
                path: self.diff_path.clone(),
                base: self.base.clone(),
            };
            let objects = Arc::new(Client::in_memory("held").unwrap());
            let frames = Arc::new(HeldFrames::new());
            push_held(&objects, &src, &diff, &cfg, &frames).unwrap();
            let chain =
                Snapshot::parse(&diff, &objects.get(&diff.manifest_key()).unwrap().unwrap())
                    .unwrap();
            HeldDiff {
                diff,
                src,
                cfg,
                objects,
                frames,
                chain,
            }
        }

        /// The pieces of `chain` the base does not hold: what the source owes.
        pub fn owed(&self, chain: &Snapshot) -> Vec<blake3::Hash> {
            let in_base = self.in_base();
            chain
                .frames
                .iter()
                .flatten()
                .map(|p| p.hash)
                .filter(|h| !in_base.contains(h))
                .collect()
        }
    }

    /// A diff held by a move's source ([`BaseAndDiff::held`]): the push that cut it (its
    /// source and configuration), the objects and frames it holds, the chain's manifest.
    pub(in crate::store) struct HeldDiff {
        pub diff: StoreUrl,
        pub src: PushSource,
        pub cfg: PushConfig,
        pub objects: Arc<Client>,
        pub frames: Arc<HeldFrames>,
        pub chain: Snapshot,
    }

    #[test]
    fn a_diff_held_in_place_makes_the_manifest_a_push_makes_and_is_served_checked() {
        let Some(scratch) = diff_scratch("held") else {
            return;
        };
        let base_bytes: Vec<u8> = (0..MEM).map(|i| (i / PAGE) as u8 ^ 0x5a).collect();
        let bd = BaseAndDiff::new(&scratch, &base_bytes);
        let (store, want) = (Arc::clone(&bd.store), &bd.want);
        let HeldDiff {
            diff,
            src,
            cfg: dcfg,
            objects: held,
            frames: held_frames,
            chain,
        } = bd.held();
        // Frame 0, the piece of frame 2, the last page: frame 5 is zero (stored nowhere).
        assert_eq!(held_frames.len(), 3);
        let plain = Arc::new(Client::in_memory("plain").unwrap());
        push(&plain, &src, &diff, &dcfg).unwrap();
        let manifest = |c: &Client| {
            let mut v: serde_json::Value =
                serde_json::from_slice(&c.get(&diff.manifest_key()).unwrap().unwrap()).unwrap();
            v["created"] = 0.into();
            v
        };
        assert_eq!(manifest(&held), manifest(&plain));

        // Served from the file, each frame checked on the one fetch path, every byte right.
        let server = PeerServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::clone(&held_frames),
            Arc::clone(&held),
        )
        .unwrap();
        let owed = bd.owed(&chain);
        assert_eq!(owed.len(), 3);
        let frames = Frames::new(Arc::clone(&store), None, FetchPolicy::default());
        let peer = Arc::new(Client::peer(&format!("http://{}", server.addr())).unwrap());
        frames.follow(Arc::clone(&peer), owed.clone());
        let memory = StoreMemory::from_snapshot(Arc::clone(&frames), chain);
        for i in 0..MEM / FB {
            let got = memory.frame(i).unwrap();
            let at = (i * FB) as usize;
            assert_eq!(got.as_slice(), &want[at..at + FB as usize], "frame {i}");
        }
        assert_eq!(frames.counters.peer_gets.load(Ordering::Relaxed), 3);
        assert_eq!(frames.counters.mismatches.load(Ordering::Relaxed), 0);

        // A HEAD is answered from the frame's length, without reading it: with the file
        // emptied, a GET fails and a HEAD still answers.
        let gets = server.counters.gets.load(Ordering::Relaxed);
        std::fs::File::options()
            .write(true)
            .open(scratch.join("diff"))
            .unwrap()
            .set_len(0)
            .unwrap();
        let key = crate::store::url::frame_key(&owed[0]);
        assert!(peer.block_on(peer.exists_async(&key)).unwrap());
        let e = peer.get(&key).unwrap_err().to_string();
        assert_eq!(server.counters.gets.load(Ordering::Relaxed), gets);
        // The failure is counted here and said there, naming the frame.
        assert!(server.counters.failed.load(Ordering::Relaxed) >= 1);
        assert!(e.contains("could not serve") && e.contains(&key), "{e}");
    }

    #[test]
    fn a_base_handed_in_with_another_frame_size_is_refused_not_cut() {
        let scratch = guestmem_testkit::Scratch::new("held-bad-base");
        let (store, base) = base_in_store(&scratch, &vec![7u8; MEM as usize]);
        std::fs::write(scratch.join("diff"), vec![9u8; MEM as usize]).unwrap();
        let frames = Frames::new(Arc::clone(&store), None, FetchPolicy::default());
        // The manifest's fields are public: a caller may hand in one read and then changed.
        for (fb, frames_len) in [(FB + 1, None), (FB * 2, None), (FB, Some(3))] {
            let mut bad = read_snapshot(&frames, &base).unwrap();
            bad.manifest.frame_bytes = fb;
            if let Some(n) = frames_len {
                bad.frames.truncate(n);
            }
            let dcfg = diff_config(&store, bad);
            let src = PushSource::RawDiff {
                path: scratch.join("diff"),
                base: base.clone(),
            };
            let held = Arc::new(Client::in_memory("held").unwrap());
            let to = StoreUrl::parse("s3://bkt/diff", false).unwrap();
            let e = push_held(&held, &src, &to, &dcfg, &HeldFrames::new()).unwrap_err();
            let e = e.to_string();
            assert!(e.contains("frame"), "{fb} {frames_len:?}: {e}");
        }
    }

    #[test]
    fn a_diff_on_a_tmpfs_with_huge_pages_is_refused_not_read_as_zeros() {
        let scratch = guestmem_testkit::Scratch::new("held-huge-tmpfs");
        let (store, base) = base_in_store(&scratch, &vec![0x77u8; MEM as usize]);
        let huge =
            match guestmem_testkit::Tmpfs::mount(scratch.join("huge"), "huge=always,size=16m") {
                Ok(t) => t,
                Err(why) => return guestmem_testkit::skip(why),
            };
        // One page written: SEEK_DATA there says 2 MiB (a whole frame and more) is data.
        let diff_path = huge.join("diff");
        let f = std::fs::File::create(&diff_path).unwrap();
        f.set_len(MEM).unwrap();
        f.write_all_at(&[1u8; PAGE as usize], PAGE).unwrap();
        drop(f);
        let snap = read_base(&store, &base);
        let e = refused_diff(&store, &base, &snap, &diff_path);
        // It names the option (or `shmem_enabled` where that forces every tmpfs) and the file.
        assert!(
            e.contains("huge") && e.contains(&diff_path.display().to_string()),
            "{e}"
        );
        // Asked before a Diff is written there (as a move asks of its work dir): the same
        // answer, naming the folder.
        let e = crate::store::check_diff_folder(&huge)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("huge") && e.contains(&huge.display().to_string()),
            "{e}"
        );
    }

    /// A diff shorter than its base's memory (cut short, or another's) is refused naming
    /// both lengths; one on a file system that reports more than the pages written as data
    /// (ramfs: the kernel's generic lseek, the whole file) is refused naming it. Neither is
    /// read with the base's pages taken for its holes, or zeros for the base's pages.
    #[test]
    fn a_diff_cut_short_or_on_a_file_system_that_reports_coarse_data_is_refused() {
        let scratch = guestmem_testkit::Scratch::new("held-short");
        let base_bytes = vec![0x77u8; MEM as usize];
        let (store, base) = base_in_store(&scratch, &base_bytes);
        let snap = read_base(&store, &base);
        let push_diff = |path: &std::path::Path| refused_diff(&store, &base, &snap, path);
        let short = scratch.join("short");
        diff_on(&base_bytes, &short);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&short)
            .unwrap()
            .set_len(MEM - 3 * PAGE)
            .unwrap();
        let e = push_diff(&short);
        assert!(
            e.contains(&format!("{:#x}", MEM - 3 * PAGE)) && e.contains(&format!("{MEM:#x}")),
            "{e}"
        );
        match guestmem_testkit::Tmpfs::mount_as("ramfs", scratch.join("ramfs"), "mode=0700") {
            Ok(ramfs) => {
                let path = ramfs.join("diff");
                diff_on(&base_bytes, &path);
                let e = push_diff(&path);
                // Asked of ramfs itself: the page written shows as the whole file.
                assert!(
                    e.contains("shows as data at [0x0..0x400000]")
                        && e.contains(&path.display().to_string()),
                    "{e}"
                );
            }
            Err(why) => guestmem_testkit::skip(why),
        }
    }

    /// A diff whose base's manifest went after the base was read (deleted, so a gc may take
    /// its frames) is not pushed naming them.
    #[test]
    fn a_diff_whose_base_went_since_it_was_read_is_refused() {
        let Some(scratch) = diff_scratch("held-base-gone") else {
            return;
        };
        let base_bytes = vec![0x33u8; MEM as usize];
        let (store, base) = base_in_store(&scratch, &base_bytes);
        let snap = read_base(&store, &base);
        let path = scratch.join("diff");
        diff_on(&base_bytes, &path);
        store.delete(&base.manifest_key()).unwrap();
        let e = refused_diff(&store, &base, &snap, &path);
        assert!(e.contains("deleted or replaced"), "{e}");
    }
}
