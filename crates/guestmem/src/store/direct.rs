//! A move's source read by the faulting thread itself: one HTTP/1.1 GET on a kept-alive TCP
//! connection, written and read by the thread that waits for the frame.
//!
//! The runtime's client (object_store over reqwest and hyper) hands each request to a
//! connection task on a runtime thread and the answer back: two wakeups across threads a
//! GET, and more while the body comes in. On this 2-CPU host that was over half of a GET's
//! time: a source's 256 KiB piece, no load, 128 us p50 through the runtime against 55 us
//! read here. No crate in reach does this (reqwest, hyper's pool and object_store drive
//! their connections on a runtime's threads), so it is written here, for one server only:
//! [`super::PeerServer`], which answers every GET with a `Content-Length`. The answer's head
//! is parsed by httparse, hyper's own parser. Read-ahead still goes through the runtime,
//! many GETs at once.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Connections kept open for the next GET (a destination's fault threads: a few).
const KEEP_IDLE: usize = 16;
/// The most bytes an answer's head may take.
const HEAD_LIMIT: usize = 16 << 10;
/// Headers an answer may carry.
const HEADERS: usize = 32;

/// Why a GET on this thread failed.
#[derive(Debug)]
pub(crate) enum DirectError {
    /// No answer within the time given.
    TimedOut,
    /// The rest: `permanent` when asking again cannot help.
    Failed { reason: String, permanent: bool },
}

/// One move's source, `http://HOST:PORT`, read from the calling thread.
#[derive(Debug)]
pub(crate) struct Direct {
    /// `HOST:PORT`, as the `Host` header and for resolving.
    authority: String,
    /// Resolved once, on the first GET.
    addrs: Mutex<Vec<SocketAddr>>,
    /// Connections whose last answer was read whole.
    idle: Mutex<Vec<TcpStream>>,
}

impl Direct {
    /// For `base` (`http://HOST:PORT`, with no path); `None` for anything else.
    pub(crate) fn new(base: &str) -> Option<Direct> {
        let authority = base.strip_prefix("http://")?.trim_end_matches('/');
        if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
            return None;
        }
        Some(Direct {
            authority: authority.into(),
            addrs: Mutex::new(Vec::new()),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Sends a GET of `key` (at most `max` bytes back) that must be answered within
    /// `limit`; [`Direct::receive`] reads its answer. In between, the caller may do other
    /// work while the request travels.
    pub(crate) fn send(&self, key: &str, max: u64, limit: Duration) -> Result<Sent, DirectError> {
        if !key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-".contains(&b))
        {
            return Err(DirectError::Failed {
                reason: format!("a key this client does not send: {key:?}"),
                permanent: true,
            });
        }
        let until = Instant::now() + limit;
        let request = format!("GET /{key} HTTP/1.1\r\nhost: {}\r\n\r\n", self.authority);
        // A kept connection the source has closed since (it closes idle ones) fails before
        // any byte of the answer: then the request goes once more, on a new one.
        if let Some(conn) = self.take_idle() {
            let mut sent = Sent {
                conn,
                kept: true,
                request,
                max,
                until,
                at: Instant::now(),
            };
            if write(&mut sent).is_ok() {
                return Ok(sent);
            }
            return self.resend(sent);
        }
        let mut sent = Sent {
            conn: self.connect(until)?,
            kept: false,
            request,
            max,
            until,
            at: Instant::now(),
        };
        write(&mut sent)?;
        Ok(sent)
    }

    /// The answer to `sent`, with how long its first byte took after the request went;
    /// `None`: the source holds no such object.
    pub(crate) fn receive(&self, sent: Sent) -> Result<Option<(Bytes, Duration)>, DirectError> {
        let mut sent = sent;
        loop {
            match exchange(&mut sent) {
                Ok((got, keep)) => {
                    if keep {
                        self.give_back(sent.conn);
                    }
                    return Ok(got);
                }
                Err(Exchange::Unanswered(_)) if sent.kept => sent = self.resend(sent)?,
                Err(Exchange::Unanswered(e) | Exchange::Failed(e)) => return Err(e),
            }
        }
    }

    /// `sent`'s request again, on a new connection.
    fn resend(&self, sent: Sent) -> Result<Sent, DirectError> {
        let mut again = Sent {
            conn: self.connect(sent.until)?,
            kept: false,
            at: Instant::now(),
            ..sent
        };
        write(&mut again)?;
        Ok(again)
    }

    fn take_idle(&self) -> Option<TcpStream> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    fn give_back(&self, conn: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < KEEP_IDLE {
            idle.push(conn);
        }
    }

    /// A new connection, within `until`.
    fn connect(&self, until: Instant) -> Result<TcpStream, DirectError> {
        let addrs = {
            let mut a = self.addrs.lock().unwrap_or_else(|e| e.into_inner());
            if a.is_empty() {
                *a = self
                    .authority
                    .to_socket_addrs()
                    .map_err(|e| transient(format!("resolve {}: {e}", self.authority)))?
                    .collect();
            }
            a.clone()
        };
        let mut last = format!("{} resolves to no address", self.authority);
        for addr in addrs {
            let left = left(until)?;
            match TcpStream::connect_timeout(&addr, left) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                    return Err(DirectError::TimedOut)
                }
                Err(e) => last = format!("connect to {addr}: {e}"),
            }
        }
        Err(transient(last))
    }
}

/// A request sent, its answer not read yet.
#[derive(Debug)]
pub(crate) struct Sent {
    conn: TcpStream,
    /// Whether `conn` carried an answer before (and may have been closed since).
    kept: bool,
    request: String,
    max: u64,
    until: Instant,
    /// When the request went.
    at: Instant,
}

/// Writes `sent`'s request.
fn write(sent: &mut Sent) -> Result<(), DirectError> {
    sent.conn
        .set_write_timeout(Some(left(sent.until)?))
        .map_err(|e| transient(format!("set a timeout: {e}")))?;
    sent.conn
        .write_all(sent.request.as_bytes())
        .map_err(|e| io_error("send", e))
}

/// Reads the answer to `sent`; whether its connection may carry another request.
fn exchange(sent: &mut Sent) -> Result<(Option<(Bytes, Duration)>, bool), Exchange> {
    let (max, until, at) = (sent.max, sent.until, sent.at);
    let conn = &mut sent.conn;
    // The head, then what of the body came with it.
    let mut buf = vec![0u8; 8 << 10];
    let mut have = 0;
    let mut first_byte = None;
    let (head_len, status, len, keep) = loop {
        if have == buf.len() {
            if buf.len() >= HEAD_LIMIT {
                return Err(Exchange::Failed(transient(format!(
                    "an answer's head past {HEAD_LIMIT} bytes"
                ))));
            }
            buf.resize(buf.len() * 2, 0);
        }
        let n = match read(conn, &mut buf[have..], until) {
            Ok(n) => n,
            // Reset before any byte of an answer: a kept connection the source closed.
            Err(e @ DirectError::Failed { .. }) if have == 0 => {
                return Err(Exchange::Unanswered(e))
            }
            Err(e) => return Err(Exchange::Failed(e)),
        };
        if n == 0 {
            let e = transient("the connection closed before an answer".into());
            return Err(match have {
                0 => Exchange::Unanswered(e),
                _ => Exchange::Failed(e),
            });
        }
        first_byte.get_or_insert_with(|| at.elapsed());
        have += n;
        let mut headers = [httparse::EMPTY_HEADER; HEADERS];
        let mut r = httparse::Response::new(&mut headers);
        match r.parse(&buf[..have]) {
            Ok(httparse::Status::Partial) => continue,
            Ok(httparse::Status::Complete(head_len)) => {
                let mut len = None;
                let mut keep = r.version == Some(1);
                for h in r.headers.iter() {
                    if h.name.eq_ignore_ascii_case("content-length") {
                        len = std::str::from_utf8(h.value)
                            .ok()
                            .and_then(|v| v.trim().parse::<u64>().ok());
                    } else if h.name.eq_ignore_ascii_case("connection") {
                        keep &= !h.value.eq_ignore_ascii_case(b"close");
                    } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                        return Err(Exchange::Failed(transient(
                            "an answer without a Content-Length".into(),
                        )));
                    }
                }
                let Some(len) = len else {
                    return Err(Exchange::Failed(transient(
                        "an answer without a Content-Length".into(),
                    )));
                };
                break (head_len, r.code.unwrap_or(0), len, keep);
            }
            Err(e) => {
                return Err(Exchange::Failed(transient(format!(
                    "an answer that is not HTTP/1.1: {e}"
                ))))
            }
        }
    };
    let failed = |status: u16| {
        Exchange::Failed(DirectError::Failed {
            reason: format!("HTTP status {status}"),
            // A source answers 5xx while it cannot read its diff: asked again until
            // the deadline, as a store's 5xx is.
            permanent: !(500..600).contains(&status),
        })
    };
    if status == 200 && len > max {
        return Err(Exchange::Failed(DirectError::Failed {
            reason: format!("{len} bytes, past the {max} its frame can take"),
            permanent: true,
        }));
    }
    // The body: read whole (a small one for any status but 200), so the connection can
    // carry the next request.
    let body_cap = match status {
        200 => max,
        _ => HEAD_LIMIT as u64,
    };
    if len > body_cap {
        return Err(failed(status));
    }
    let mut body = Vec::with_capacity(len as usize);
    let came = (have - head_len).min(len as usize);
    body.extend_from_slice(&buf[head_len..head_len + came]);
    let extra = have - head_len - came;
    body.resize(len as usize, 0);
    let mut filled = came;
    while filled < body.len() {
        let n = read(conn, &mut body[filled..], until)?;
        if n == 0 {
            return Err(Exchange::Failed(transient(format!(
                "the connection closed {filled} bytes into a {len}-byte answer"
            ))));
        }
        filled += n;
    }
    // Bytes past the answer: not a source this client reads; not used again.
    let keep = keep && extra == 0;
    match status {
        200 => Ok((
            Some((Bytes::from(body), first_byte.unwrap_or_default())),
            keep,
        )),
        404 => Ok((None, keep)),
        s => Err(failed(s)),
    }
}

/// How an exchange failed: before any byte of an answer (a kept connection closed), or after.
enum Exchange {
    Unanswered(DirectError),
    Failed(DirectError),
}

impl From<DirectError> for Exchange {
    fn from(e: DirectError) -> Exchange {
        Exchange::Failed(e)
    }
}

fn transient(reason: String) -> DirectError {
    DirectError::Failed {
        reason,
        permanent: false,
    }
}

fn left(until: Instant) -> Result<Duration, DirectError> {
    let left = until.saturating_duration_since(Instant::now());
    match left.is_zero() {
        true => Err(DirectError::TimedOut),
        false => Ok(left),
    }
}

fn io_error(op: &str, e: std::io::Error) -> DirectError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => DirectError::TimedOut,
        _ => transient(format!("{op}: {e}")),
    }
}

/// One read, waiting at most until `until`.
fn read(conn: &mut TcpStream, buf: &mut [u8], until: Instant) -> Result<usize, DirectError> {
    conn.set_read_timeout(Some(left(until)?))
        .map_err(|e| transient(format!("set a timeout: {e}")))?;
    loop {
        match conn.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r.map_err(|e| io_error("receive", e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::net::TcpListener;
    use std::sync::Arc;

    use super::*;
    use crate::store::{Client, HeldFrames, PeerServer};

    /// A server answering each connection's requests with `answers` in turn (one connection
    /// after another), then closing it; what it was asked, in order.
    fn scripted(answers: Vec<Vec<Vec<u8>>>) -> (SocketAddr, std::thread::JoinHandle<Vec<String>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut asked = Vec::new();
            for conn in answers {
                let (s, _) = l.accept().unwrap();
                let mut r = BufReader::new(s.try_clone().unwrap());
                let mut w = s;
                for answer in conn {
                    let mut line = String::new();
                    r.read_line(&mut line).unwrap();
                    asked.push(line.trim().to_string());
                    // The rest of the head.
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
                            break;
                        }
                    }
                    w.write_all(&answer).unwrap();
                }
            }
            asked
        });
        (addr, t)
    }

    fn ok(body: &[u8]) -> Vec<u8> {
        let mut a =
            format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes();
        a.extend_from_slice(body);
        a
    }

    fn get(d: &Direct, key: &str, max: u64) -> Result<Option<Bytes>, DirectError> {
        let sent = d.send(key, max, Duration::from_secs(5))?;
        d.receive(sent).map(|g| g.map(|(b, _)| b))
    }

    #[test]
    fn answers_are_read_whole_and_a_connection_closed_while_kept_is_asked_again() {
        // Two answers on the first connection, then it closes; the third GET finds it
        // closed and goes again on a second connection.
        let (addr, server) = scripted(vec![
            vec![
                ok(b"one"),
                b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec(),
            ],
            vec![ok(&vec![7u8; 300 << 10])],
        ]);
        let d = Direct::new(&format!("http://{addr}/")).unwrap();
        assert_eq!(get(&d, "frames/a1", 1 << 20).unwrap().unwrap(), &b"one"[..]);
        assert!(
            get(&d, "frames/b2", 1 << 20).unwrap().is_none(),
            "404: none"
        );
        let big = get(&d, "frames/c3", 1 << 20).unwrap().unwrap();
        assert!(big.len() == 300 << 10 && big.iter().all(|&b| b == 7));
        assert_eq!(
            server.join().unwrap(),
            [
                "GET /frames/a1 HTTP/1.1",
                "GET /frames/b2 HTTP/1.1",
                "GET /frames/c3 HTTP/1.1"
            ]
        );
        assert_eq!(d.idle.lock().unwrap().len(), 1, "kept for the next GET");
    }

    #[test]
    fn what_a_source_must_not_send_fails_and_says_why() {
        let cases: [(&[u8], &str, bool); 5] = [
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n",
                "past the 64",
                true,
            ),
            (
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                "Content-Length",
                false,
            ),
            (
                b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n",
                "status 503",
                false,
            ),
            (
                b"HTTP/1.1 403 No\r\ncontent-length: 0\r\n\r\n",
                "status 403",
                true,
            ),
            (b"SSH-2.0-OpenSSH\r\n\r\n", "not HTTP/1.1", false),
        ];
        for (answer, says, permanent) in cases {
            let (addr, server) = scripted(vec![vec![answer.to_vec()]]);
            let d = Direct::new(&format!("http://{addr}")).unwrap();
            match get(&d, "frames/x", 64) {
                Err(DirectError::Failed {
                    reason,
                    permanent: p,
                }) => {
                    assert!(reason.contains(says), "{reason}");
                    assert_eq!(p, permanent, "{reason}");
                }
                other => panic!("{says}: {other:?}"),
            }
            server.join().unwrap();
            assert!(d.idle.lock().unwrap().is_empty(), "{says}: not kept");
        }
        // A body cut short, and a source that never answers: a time-out, in time.
        let (addr, server) = scripted(vec![vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nabc".to_vec(),
        ]]);
        let d = Direct::new(&format!("http://{addr}")).unwrap();
        let e = get(&d, "frames/x", 64).unwrap_err();
        assert!(
            matches!(&e, DirectError::Failed { reason, .. } if reason.contains("3 bytes into a 9-byte")),
            "{e:?}"
        );
        server.join().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let d = Direct::new(&format!("http://{}", l.local_addr().unwrap())).unwrap();
        let t = Instant::now();
        let sent = d.send("frames/x", 64, Duration::from_millis(200)).unwrap();
        assert!(matches!(d.receive(sent), Err(DirectError::TimedOut)));
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        // Keys and addresses it does not send to.
        assert!(matches!(
            d.send("frames/x y", 64, Duration::from_secs(1)),
            Err(DirectError::Failed {
                permanent: true,
                ..
            })
        ));
        for bad in ["https://h:1", "http://", "http://h:1/path", "http://u@h:1"] {
            assert!(Direct::new(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_fault_reads_its_frame_from_the_source_on_its_own_thread() {
        let held = Arc::new(Client::in_memory("held").unwrap());
        let p: Vec<u8> = (0..64 << 10).map(|i| (i * 31) as u8).collect();
        let hash = blake3::hash(&p);
        let key = crate::store::url::frame_key(&hash);
        held.put(&key, Bytes::from(crate::store::frame::raw(&p)))
            .unwrap();
        let server = PeerServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(HeldFrames::new()),
            Arc::clone(&held),
        )
        .unwrap();
        let store = Arc::new(Client::in_memory("store").unwrap());
        let peer = Arc::new(Client::peer(&format!("http://{}", server.addr())).unwrap());
        let frames =
            crate::store::Frames::new(store, None, crate::store::fetch::FetchPolicy::default());
        frames.follow(Arc::clone(&peer), [hash]);
        let direct = peer.direct().unwrap();
        // Outside a fault: through the runtime.
        assert_eq!(*frames.get(&hash, p.len()).unwrap(), p);
        assert!(direct.idle.lock().unwrap().is_empty());
        // A fault's: on its thread, the connection kept.
        let frames2 = crate::store::Frames::new(
            Arc::new(Client::in_memory("s2").unwrap()),
            None,
            crate::store::fetch::FetchPolicy::default(),
        );
        frames2.follow(Arc::clone(&peer), [hash]);
        let _here = crate::store::fetch::read_here();
        assert_eq!(*frames2.get(&hash, p.len()).unwrap(), p);
        assert_eq!(direct.idle.lock().unwrap().len(), 1);
        assert_eq!(
            server
                .counters
                .gets
                .load(std::sync::atomic::Ordering::Relaxed),
            2
        );
    }
}
