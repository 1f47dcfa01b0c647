//! Where an operator reaches a running fleet: a control socket (a Unix stream socket,
//! one command a connection: `status` answers the status as JSON, `health` whether it
//! serves, `drain` starts the drain, `metrics` the Prometheus text) and, opt in, an HTTP
//! address for a metrics scraper (`GET /metrics`, `GET /health`).
//!
//! Each runs on one thread of its own that blocks in `poll` on its socket and a stop
//! eventfd; a client has 2 s to send its command and is answered and closed, so a client
//! that says nothing holds up only other clients of the same socket, never the fleet.

use std::io::{self, Read, Write};
#[cfg(feature = "metrics")]
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::status::StatusHandle;
use super::Drainer;
use crate::restore::remote::Listener;

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
        let mut fds = [fd, stop].map(|f| libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: two live pollfds; no timeout (idle means blocked).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return false;
        }
        if fds[1].revents != 0 {
            return false;
        }
        if fds[0].revents != 0 {
            return true;
        }
    }
}

/// Reads a request until `end` says it is whole, within the client timeout and size cap.
fn read_request(mut s: impl Read, end: fn(&[u8]) -> bool) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while buf.len() < MAX_REQUEST_BYTES && !end(&buf) {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    buf
}

/// Whether the process on the other end runs as this process's user, or as root.
fn peer_is_us(s: &std::os::unix::net::UnixStream) -> bool {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred is a live ucred and len its size; the kernel writes at most len bytes.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    // SAFETY: geteuid takes nothing and cannot fail.
    let us = unsafe { libc::geteuid() };
    r == 0 && (cred.uid == us || cred.uid == 0)
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
                let Ok((mut s, _)) = listener.socket().accept() else {
                    continue;
                };
                if s.set_nonblocking(false).is_err()
                    || s.set_read_timeout(Some(CLIENT_TIMEOUT)).is_err()
                    || s.set_write_timeout(Some(CLIENT_TIMEOUT)).is_err()
                {
                    continue;
                }
                // Only this user (or root) commands the server: a hand-off gives away every
                // VM's memory.
                if !peer_is_us(&s) {
                    let _ = s.write_all(b"{\"error\":\"not this server's user\"}\n");
                    continue;
                }
                let req = read_request(&s, |b| b.contains(&b'\n'));
                let line = String::from_utf8_lossy(&req);
                if line.trim() == super::handoff::COMMAND {
                    // The connection is the new server's: the fleet answers it.
                    let _ = s.set_read_timeout(None);
                    drainer.hand_off(s);
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
                    other => format!(
                        "{{\"error\":\"unknown command {:?}: status, health, drain or metrics\"}}",
                        other.chars().take(64).collect::<String>()
                    ),
                };
                let _ = s.write_all(reply.as_bytes());
                let _ = s.write_all(b"\n");
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
                let Ok((mut s, _)) = listener.accept() else {
                    continue;
                };
                if s.set_nonblocking(false).is_err()
                    || s.set_read_timeout(Some(CLIENT_TIMEOUT)).is_err()
                    || s.set_write_timeout(Some(CLIENT_TIMEOUT)).is_err()
                {
                    continue;
                }
                let req = read_request(&s, |b| b.windows(4).any(|w| w == b"\r\n\r\n"));
                let head = String::from_utf8_lossy(&req);
                let path = head.split_whitespace().nth(1).unwrap_or("");
                let (code, kind, body) = match (head.starts_with("GET "), path) {
                    (true, "/metrics") => (
                        "200 OK",
                        "text/plain; version=0.0.4; charset=utf-8",
                        status.prometheus(),
                    ),
                    (true, "/health") => ("200 OK", "text/plain", "ok\n".to_string()),
                    _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
                };
                let _ = write!(
                    s,
                    "HTTP/1.0 {code}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        })?;
        Ok((exposed, bound))
    }
}
