//! Where an operator reaches a running page server: a control socket (a Unix stream socket,
//! one command a connection: `status` answers the status as JSON, `health` whether it
//! serves, `drain` starts the drain, `metrics` the Prometheus text) and, opt in, an HTTP
//! address for a metrics scraper (`GET /metrics`, `GET /health`).
//!
//! Each runs on one thread of its own that blocks in `poll` on its socket and a stop
//! eventfd; a client has 2 s to send its command and is answered and closed, so a client
//! that says nothing holds up only other clients of the same socket, never the server.

use std::io::{self, Read, Write};
#[cfg(feature = "metrics")]
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::status::StatusHandle;
use super::{Drainer, Listener};
use crate::sys::PollFd;

/// How long a client has to send its request.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest request read.
const MAX_REQUEST_BYTES: usize = 8 << 10;

/// A thread answering clients until dropped.
#[derive(Debug)]
pub struct Exposed {
    stop: Arc<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Exposed {
    fn drop(&mut self) {
        let _ = crate::sys::eventfd_signal(self.stop.as_fd());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Blocks until `fd` is readable (`true`) or `stop` is (`false`).
fn wait(fd: BorrowedFd<'_>, stop: BorrowedFd<'_>) -> bool {
    loop {
        let mut fds = [PollFd::readable(fd), PollFd::readable(stop)];
        // No timeout: idle means blocked.
        if crate::sys::poll(&mut fds, None).is_err() || fds[1].ready() {
            return false;
        }
        if fds[0].ready() {
            return true;
        }
    }
}

/// A client's socket, with one deadline for its whole exchange.
trait Timed: Read + Write {
    fn set_timeouts(&self, left: Duration) -> io::Result<()>;
}

impl Timed for std::os::unix::net::UnixStream {
    fn set_timeouts(&self, left: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(left))?;
        self.set_write_timeout(Some(left))
    }
}

#[cfg(feature = "metrics")]
impl Timed for std::net::TcpStream {
    fn set_timeouts(&self, left: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(left))?;
        self.set_write_timeout(Some(left))
    }
}

/// Time left before `deadline`, at least 1 ms (a zero timeout means none to the kernel).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Reads a request until `end` says it is whole, by `deadline` and within the size cap: a
/// client trickling bytes holds the thread no longer than the deadline.
fn read_request(s: &mut impl Timed, end: fn(&[u8]) -> bool, deadline: Instant) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while buf.len() < MAX_REQUEST_BYTES && !end(&buf) && Instant::now() < deadline {
        if s.set_timeouts(left(deadline)).is_err() {
            break;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    buf
}

/// Writes a reply by `deadline` (a client that does not read is cut off then).
fn write_reply(s: &mut impl Timed, bytes: &[u8], deadline: Instant) {
    let mut at = 0;
    while at < bytes.len() && Instant::now() < deadline {
        if s.set_timeouts(left(deadline)).is_err() {
            return;
        }
        match s.write(&bytes[at..]) {
            Ok(0) | Err(_) => return,
            Ok(n) => at += n,
        }
    }
}

/// A client just accepted, made blocking, with its deadline; `None` when there was none
/// (or it could not be set up). A failed `accept` (out of descriptors, say) leaves the
/// listener readable: it waits a little rather than spin.
fn client<S>(
    accepted: io::Result<S>,
    blocking: impl FnOnce(&S) -> io::Result<()>,
) -> Option<(S, Instant)> {
    match accepted {
        Ok(s) => blocking(&s)
            .ok()
            .map(|()| (s, Instant::now() + CLIENT_TIMEOUT)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
        Err(_) => {
            std::thread::sleep(Duration::from_millis(100));
            None
        }
    }
}

fn spawn(name: &str, f: impl FnOnce(Arc<OwnedFd>) + Send + 'static) -> io::Result<Exposed> {
    let stop = Arc::new(crate::sys::eventfd()?);
    let s2 = stop.clone();
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || f(s2))?;
    Ok(Exposed {
        stop,
        thread: Some(thread),
    })
}

impl StatusHandle {
    /// Answers commands on `listener` (see the module docs) until the result is dropped.
    pub fn serve_control(&self, listener: Listener, drainer: Drainer) -> io::Result<Exposed> {
        let status = self.clone();
        spawn("guestmem-control", move |stop| {
            while wait(listener.socket().as_fd(), stop.as_fd()) {
                let Some((mut s, deadline)) =
                    client(listener.socket().accept().map(|c| c.0), |s| {
                        s.set_nonblocking(false)
                    })
                else {
                    continue;
                };
                // Only this user (or root) commands the server: a hand-off gives away every
                // VM's memory.
                if !super::peer::same_user(&s) {
                    write_reply(
                        &mut s,
                        b"{\"error\":\"not this server's user\"}\n",
                        deadline,
                    );
                    continue;
                }
                let req = read_request(&mut s, |b| b.contains(&b'\n'), deadline);
                let line = String::from_utf8_lossy(&req);
                if let Some(asked) = super::handoff::Asked::parse(line.trim()) {
                    // The connection is the new server's: the server answers it.
                    let _ = s.set_read_timeout(None);
                    let _ = s.set_write_timeout(Some(super::handoff::SEND_WAIT));
                    drainer.hand_off(s, asked);
                    continue;
                }
                let reply = match line.trim() {
                    "status" => serde_json::to_string_pretty(&status.snapshot())
                        .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")),
                    "health" => {
                        let st = status.snapshot();
                        format!(
                            "{{\"ok\":true,\"draining\":{},\"vms\":{}}}",
                            st.draining,
                            st.sessions.len()
                        )
                    }
                    "drain" => {
                        drainer.drain();
                        "{\"draining\":true}".into()
                    }
                    #[cfg(feature = "metrics")]
                    "metrics" => status.prometheus(),
                    // JSON whatever was sent (a control character as `\u0001`, not Rust's
                    // `\u{1}`).
                    other => serde_json::json!({
                        "error": format!(
                            "unknown command {}: status, health, drain or metrics",
                            serde_json::Value::from(other.chars().take(64).collect::<String>())
                        )
                    })
                    .to_string(),
                };
                write_reply(&mut s, format!("{reply}\n").as_bytes(), deadline);
            }
        })
    }

    /// Answers `GET /metrics` (Prometheus text) and `GET /health` on `addr` until the
    /// result is dropped.
    #[cfg(feature = "metrics")]
    pub fn serve_metrics(&self, addr: SocketAddr) -> io::Result<(Exposed, SocketAddr)> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let bound = listener.local_addr()?;
        let status = self.clone();
        let exposed = spawn("guestmem-metrics", move |stop| {
            while wait(listener.as_fd(), stop.as_fd()) {
                let Some((mut s, deadline)) =
                    client(listener.accept().map(|c| c.0), |s| s.set_nonblocking(false))
                else {
                    continue;
                };
                let req =
                    read_request(&mut s, |b| b.windows(4).any(|w| w == b"\r\n\r\n"), deadline);
                let head = String::from_utf8_lossy(&req);
                let path = head.split_whitespace().nth(1).unwrap_or("");
                let (code, kind, body) = match (head.starts_with("GET "), path) {
                    (true, "/metrics") => (
                        "200 OK",
                        // prometheus-client writes OpenMetrics text (`_total`, `# EOF`).
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        status.prometheus(),
                    ),
                    (true, "/health") => ("200 OK", "text/plain", "ok\n".to_string()),
                    _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
                };
                let response = format!(
                    "HTTP/1.0 {code}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{body}",
                    body.len()
                );
                write_reply(&mut s, response.as_bytes(), deadline);
            }
        })?;
        Ok((exposed, bound))
    }
}
