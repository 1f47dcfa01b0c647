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
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::StoreError;

/// Connections kept open for the next GET (a destination's fault threads: a few).
const KEEP_IDLE: usize = 16;
/// A kept connection idle this long is closed here, before the source closes it (after
/// 30 s without a request, [`super::peer`]).
const IDLE_FOR: Duration = Duration::from_secs(20);
/// The shortest wait for an answer: one that came while this thread was busy elsewhere
/// past its time is still read, not dropped as late.
const LAST_LOOK: Duration = Duration::from_millis(1);
/// The most bytes an answer's head may take.
const HEAD_LIMIT: usize = 16 << 10;
/// Headers an answer may carry.
const HEADERS: usize = 32;

thread_local!(static READ_HERE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });

/// While it lives, a GET that this thread's own fetch sends to a move's source is written
/// and read on this thread  instead of through the client's runtime.
/// Taken by a fault's frame read, on a thread outside the runtime that waits for the frame
/// anyway; never on a runtime thread, where a blocking read would stall other requests.
#[must_use]
pub(crate) struct ReadHere(bool, std::marker::PhantomData<*const ()>);

/// [`ReadHere`], for this thread (and only it: not `Send`).
pub(crate) fn read_here() -> ReadHere {
    ReadHere(READ_HERE.replace(true), std::marker::PhantomData)
}

impl Drop for ReadHere {
    fn drop(&mut self) {
        READ_HERE.set(self.0);
    }
}

/// Whether this thread reads its own GETs to a move's source ([`ReadHere`]).
pub(crate) fn reads_here() -> bool {
    READ_HERE.get()
}

/// Why a GET on this thread failed.
#[derive(Debug)]
pub(crate) enum DirectError {
    /// No answer within the time given.
    TimedOut,
    /// The rest: `permanent` when asking again cannot help.
    Failed { reason: String, permanent: bool },
}

/// One move's source, `http://IP:PORT`, read from the calling thread.
#[derive(Debug)]
pub(crate) struct Direct {
    addr: SocketAddr,
    /// `IP:PORT`, as the `Host` header.
    authority: String,
    /// Headers every request carries after `Host` (a locked source's token), each line
    /// ending in CRLF.
    extra: Hidden,
    /// Connections whose last answer was read whole, and since when idle.
    idle: Mutex<Vec<(TcpStream, Instant)>>,
}

impl Direct {
    /// For `base`, `http://IP:PORT` (no path); `None` for anything else (a host name, no
    /// port), which the runtime's client reads: no name is looked up on a fault's thread.
    pub(crate) fn new(base: &str, token: Option<&str>) -> Option<Direct> {
        let authority = base.strip_prefix("http://")?.trim_end_matches('/');
        let addr: SocketAddr = authority.parse().ok()?;
        // A token is hex; anything else is not sent (the runtime's client refuses it too).
        if token.is_some_and(|t| !t.bytes().all(|b| b.is_ascii_alphanumeric())) {
            return None;
        }
        Some(Direct {
            addr,
            authority: addr.to_string(),
            extra: Hidden(token.map_or(String::new(), |t| {
                format!("authorization: Guestmem {t}\r\n")
            })),
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
        let now = Instant::now();
        let until = now
            .checked_add(limit)
            .unwrap_or(now + Duration::from_secs(86400 * 365));
        let request = Hidden(format!(
            "GET /{key} HTTP/1.1\r\nhost: {}\r\n{}\r\n",
            self.authority, self.extra.0
        ));
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

    /// A GET of `key` on this thread (a fault's own, which has nothing else to do until its
    /// frame is in), answered as the fetch path takes a client's: `Err(())` when no answer
    /// came within `limit`, a failure as the [`StoreError`] of a GET of `url()`. The
    /// request goes first; the frame's other pieces are read from the cache while it
    /// travels.
    pub(crate) async fn get_here(
        &self,
        key: &str,
        max: u64,
        limit: Duration,
        url: impl FnOnce() -> String,
    ) -> Result<Result<Option<(Bytes, Duration)>, StoreError>, ()> {
        let got = match self.send(key, max, limit) {
            Ok(sent) => {
                tokio::task::yield_now().await;
                self.receive(sent)
            }
            Err(e) => Err(e),
        };
        match got {
            Ok(g) => Ok(Ok(g)),
            Err(DirectError::TimedOut) => Err(()),
            Err(DirectError::Failed { reason, permanent }) => Ok(Err(StoreError::Request {
                op: "GET",
                url: url(),
                reason,
                permanent,
            })),
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

    /// A kept connection that is still open and has nothing unread (a look that does not
    /// wait); those idle too long, closed or holding bytes nobody asked for are dropped.
    fn take_idle(&self) -> Option<TcpStream> {
        loop {
            let (conn, since) = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
            if since.elapsed() >= IDLE_FOR || conn.set_nonblocking(true).is_err() {
                continue;
            }
            let quiet = matches!(conn.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            if quiet && conn.set_nonblocking(false).is_ok() {
                return Some(conn);
            }
        }
    }

    fn give_back(&self, conn: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|(_, since)| since.elapsed() < IDLE_FOR);
        if idle.len() < KEEP_IDLE {
            idle.push((conn, Instant::now()));
        }
    }

    /// A new connection, within `until`.
    fn connect(&self, until: Instant) -> Result<TcpStream, DirectError> {
        match TcpStream::connect_timeout(&self.addr, left(until)?) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                Ok(s)
            }
            Err(e) => Err(io_error(&format!("connect to {}", self.addr), e)),
        }
    }
}

/// Text that may hold a source's token: its `Debug` shows none of it.
struct Hidden(String);

impl std::fmt::Debug for Hidden {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({} bytes)", self.0.len())
    }
}

/// A request sent, its answer not read yet.
#[derive(Debug)]
pub(crate) struct Sent {
    conn: TcpStream,
    /// Whether `conn` carried an answer before (and may have been closed since).
    kept: bool,
    request: Hidden,
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
        .write_all(sent.request.0.as_bytes())
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
                let bad = |why: &str| Err(Exchange::Failed(transient(why.into())));
                for h in r.headers.iter() {
                    if h.name.eq_ignore_ascii_case("content-length") {
                        let v = std::str::from_utf8(h.value)
                            .ok()
                            .and_then(|v| v.trim().parse::<u64>().ok());
                        if v.is_none() || len.is_some_and(|l| Some(l) != v) {
                            return bad("an answer with a Content-Length it cannot read");
                        }
                        len = v;
                    } else if h.name.eq_ignore_ascii_case("connection") {
                        keep &= !h
                            .value
                            .split(|&b| b == b',')
                            .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"));
                    } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                        return bad("an answer without a Content-Length");
                    }
                }
                let code = r.code.unwrap_or(0);
                if code < 200 {
                    // The source never sends 1xx (its requests carry no Expect).
                    return bad(&format!("an interim answer (HTTP status {code})"));
                }
                let Some(len) = len else {
                    return bad("an answer without a Content-Length");
                };
                break (head_len, code, len, keep);
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
            // As the runtime's client takes a store's answers: refused (401, 403) is
            // final; the rest (a source that cannot read its diff answers 500) is asked
            // again until the deadline.
            permanent: matches!(status, 401 | 403),
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

/// One read, waiting at most until `until` (or [`LAST_LOOK`], when that is sooner); past
/// `until` by more than that, only what has come already (`MSG_DONTWAIT`): an answer that
/// trickles in a byte at a time cannot keep a fault's own thread reading past its deadline
/// (each read once had a look of its own, so 0.9 ms a byte went on for minutes), and one
/// that came whole while this thread was busy elsewhere is still read.
fn read(conn: &mut TcpStream, buf: &mut [u8], until: Instant) -> Result<usize, DirectError> {
    let now = Instant::now();
    if now > until + LAST_LOOK {
        use std::os::fd::AsRawFd;
        // SAFETY: a read into `buf`, at most its length, on a socket this function borrows.
        let n = unsafe {
            libc::recv(
                conn.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        return match n {
            n if n >= 0 => Ok(n as usize),
            _ => Err(io_error("receive", std::io::Error::last_os_error())),
        };
    }
    let wait = until.saturating_duration_since(now).max(LAST_LOOK);
    conn.set_read_timeout(Some(wait))
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
        let d = Direct::new(&format!("http://{addr}/"), None).unwrap();
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
        let cases: [(&[u8], &str, bool); 8] = [
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
            (
                b"HTTP/1.1 408 Timeout\r\ncontent-length: 0\r\n\r\n",
                "status 408",
                false,
            ),
            (b"HTTP/1.1 103 Early\r\n\r\n", "interim", false),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabc",
                "cannot read",
                false,
            ),
            (b"SSH-2.0-OpenSSH\r\n\r\n", "not HTTP/1.1", false),
        ];
        for (answer, says, permanent) in cases {
            let (addr, server) = scripted(vec![vec![answer.to_vec()]]);
            let d = Direct::new(&format!("http://{addr}"), None).unwrap();
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
        let d = Direct::new(&format!("http://{addr}"), None).unwrap();
        let e = get(&d, "frames/x", 64).unwrap_err();
        assert!(
            matches!(&e, DirectError::Failed { reason, .. } if reason.contains("3 bytes into a 9-byte")),
            "{e:?}"
        );
        server.join().unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let d = Direct::new(&format!("http://{}", l.local_addr().unwrap()), None).unwrap();
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
        // Nor does it look names up, or take anything but IP:PORT (those go through the
        // runtime's client).
        for bad in [
            "https://10.0.0.1:1",
            "http://",
            "http://10.0.0.1:1/path",
            "http://u@10.0.0.1:1",
            "http://10.0.0.1",
            "http://localhost:1",
        ] {
            assert!(Direct::new(bad, None).is_none(), "{bad}");
        }
        assert!(Direct::new("http://[::1]:80/", None).is_some());
    }

    /// An answer that trickles in (a byte every half millisecond) ends at its deadline,
    /// not when the last byte comes: before, each read past the deadline had a millisecond
    /// of its own, and this one's 64 KiB took half a minute.
    #[test]
    fn an_answer_that_trickles_in_ends_at_its_deadline() {
        use std::io::Write;
        let (addr, source) = guestmem_testkit::http_once(|mut w| {
            let _ = w.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 65536\r\n\r\n");
            for _ in 0..65536 {
                if w.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
        });
        let d = Direct::new(&format!("http://{addr}"), None).unwrap();
        let t = Instant::now();
        let sent = d
            .send("frames/x", 1 << 20, Duration::from_millis(100))
            .unwrap();
        let got = d.receive(sent);
        assert!(matches!(got, Err(DirectError::TimedOut)), "{got:?}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        drop(d);
        source.join().unwrap();
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
        let _here = crate::store::direct::read_here();
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

    #[test]
    fn a_fault_reads_on_its_thread_only_when_the_rest_of_its_frame_is_here() {
        use crate::store::fetch::{FetchPolicy, Frames};
        use crate::store::peer::held_tests::{diff_scratch, BaseAndDiff, HeldDiff, FB, MEM, PAGE};
        use crate::store::{FrameCache, StoreMemory};

        let Some(scratch) = diff_scratch("direct-here") else {
            return;
        };
        let base_bytes: Vec<u8> = (0..MEM).map(|i| (i / PAGE) as u8 ^ 0x3c).collect();
        let bd = BaseAndDiff::new(&scratch, &base_bytes);
        let (store, want) = (Arc::clone(&bd.store), &bd.want);
        let HeldDiff {
            objects: held,
            frames: held_frames,
            chain,
            ..
        } = bd.held();
        let owed = bd.owed(&chain);
        let server = PeerServer::start("127.0.0.1:0".parse().unwrap(), held_frames, held).unwrap();
        let peer = Arc::new(Client::peer(&format!("http://{}", server.addr())).unwrap());
        let cache = Arc::new(FrameCache::open(&scratch.join("cache"), 16 << 20).unwrap());
        // Frame 2: the base's piece and three pages of the diff's.
        assert_eq!(chain.frames[2].len(), 2);
        let frame2 = |frames: &Arc<Frames>| {
            frames.follow(Arc::clone(&peer), owed.iter().copied());
            let memory = StoreMemory::from_snapshot(Arc::clone(frames), chain.clone());
            let got = memory.frame(2).unwrap();
            assert_eq!(got.as_slice(), &want[2 * FB as usize..3 * FB as usize]);
            frames.settle();
        };
        // The base's piece is fetched too: the whole frame through the runtime.
        let cold = Arc::new(Frames::new(
            Arc::clone(&store),
            Some(Arc::clone(&cache)),
            FetchPolicy::default(),
        ));
        frame2(&cold);
        let direct = peer.direct().unwrap();
        assert!(
            direct.idle.lock().unwrap().is_empty(),
            "through the runtime"
        );
        // The base's piece in the cache (kept by the read above), the diff's asked for
        // again by another host's fetcher: on the fault's thread.
        let warm = Arc::new(Frames::new(
            Arc::new(Client::in_memory("s2").unwrap()),
            Some(Arc::new(
                FrameCache::open(&scratch.join("cache2"), 16 << 20).unwrap(),
            )),
            FetchPolicy::default(),
        ));
        let base_piece = chain.frames[2][0].hash;
        warm.cache()
            .unwrap()
            .put(&base_piece, &base_bytes[2 * FB as usize..3 * FB as usize]);
        frame2(&warm);
        assert_eq!(
            direct.idle.lock().unwrap().len(),
            1,
            "on the fault's thread"
        );
        assert_eq!(
            warm.counters
                .peer_gets
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        assert_eq!(
            warm.counters
                .gets
                .load(std::sync::atomic::Ordering::Relaxed),
            1,
            "the base's piece from the cache"
        );
    }
}
