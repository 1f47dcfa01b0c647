//! A TCP proxy in front of the S3 server that makes it look remote: every response's first
//! byte waits until `first_byte` after the request that asked for it (a floor under the
//! time to first byte, the local server's own time inside it, as a remote store's
//! published first-byte latency is), and every byte to the client goes through one
//! bandwidth cap shared by all connections (a host's link). It stands for a wire, so it
//! should cost this host's CPUs as little as one: responses move from socket to socket by
//! `splice`, never copied through the proxy's memory. [`Proxy::start_rtt`] stands for a
//! link between two hosts instead: each direction half a round trip late, added to the
//! other side's own time (the move's scenario).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The link every connection's responses share.
#[derive(Debug)]
struct Link {
    /// Bytes per second (0: no cap).
    rate: u64,
    /// When the link is free to send again.
    free_at: Mutex<Instant>,
}

impl Link {
    /// Waits until `n` bytes have gone over the link.
    fn send(&self, n: usize) {
        if self.rate == 0 {
            return;
        }
        let dur = Duration::from_secs_f64(n as f64 / self.rate as f64);
        let done = {
            let mut f = self.free_at.lock().unwrap_or_else(|e| e.into_inner());
            let start = (*f).max(Instant::now());
            *f = start + dur;
            *f
        };
        let now = Instant::now();
        if done > now {
            std::thread::sleep(done - now);
        }
    }
}

/// A running proxy; stopped on drop.
pub struct Proxy {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Listens on 127.0.0.1 and forwards to `upstream`.
    pub fn start(
        upstream: SocketAddr,
        first_byte: Duration,
        bytes_per_sec: u64,
    ) -> std::io::Result<Proxy> {
        let link = Arc::new(Link {
            rate: bytes_per_sec,
            free_at: Mutex::new(Instant::now()),
        });
        Proxy::serve("s3-proxy", move |client| {
            let link = Arc::clone(&link);
            move || conn(client, upstream, first_byte, link)
        })
    }

    /// Listens on 127.0.0.1 and forwards to `upstream` as a link with a round trip of
    /// `rtt`: every byte, either way, is delivered half of it after the proxy read it (a
    /// request reaches the server `rtt / 2` late, its answer the client `rtt / 2` after
    /// the server sent it: the round trip added to the server's own time, not a floor
    /// under it as [`Proxy::start`]'s first byte is). Bytes are copied through the
    /// proxy's memory, at most 64 MiB a direction held at once.
    pub fn start_rtt(upstream: SocketAddr, rtt: Duration) -> std::io::Result<Proxy> {
        Proxy::serve("rtt-proxy", move |client| {
            move || conn_rtt(client, upstream, rtt / 2)
        })
    }

    /// Listens on 127.0.0.1, each connection served on a thread of its own by what `conn`
    /// makes of it.
    fn serve<C, F>(name: &'static str, conn: C) -> std::io::Result<Proxy>
    where
        C: Fn(TcpStream) -> F + Send + 'static,
        F: FnOnce() + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let st = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                // Blocked in accept, not polling it: a client's new connection (a pool
                // opening one more while its others are busy) is taken at once, where a
                // 5 ms poll added up to 5 ms to its first request. Drop wakes it with a
                // connection of its own.
                as_the_wire();
                loop {
                    let got = listener.accept();
                    if st.load(Ordering::Relaxed) {
                        break;
                    }
                    match got {
                        Ok((client, _)) => {
                            let _ = std::thread::Builder::new()
                                .name(format!("{name}-conn"))
                                .spawn(conn(client));
                        }
                        // Out of descriptors, say: not a spin at real-time priority.
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })?;
        Ok(Proxy {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            // Its accept returns with this connection and sees the stop. Should the connect
            // fail (no descriptor left), the thread is left blocked rather than joined.
            if TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)).is_ok() {
                let _ = t.join();
            }
        }
    }
}

/// One connection: requests forwarded as they come; each response held until `first_byte`
/// after its request, then paced by the link.
fn conn(client: TcpStream, upstream: SocketAddr, first_byte: Duration, link: Arc<Link>) {
    as_the_wire();
    let Ok(server) = TcpStream::connect(upstream) else {
        return;
    };
    let _ = server.set_nodelay(true);
    let _ = client.set_nodelay(true);
    // When the last request went up, and whether its response has not started yet.
    let asked: Arc<Mutex<(Instant, bool)>> = Arc::new(Mutex::new((Instant::now(), false)));
    let (mut c_in, mut s_out) = match (client.try_clone(), server.try_clone()) {
        (Ok(c), Ok(s)) => (c, s),
        _ => return,
    };
    let a = Arc::clone(&asked);
    let up = std::thread::spawn(move || {
        as_the_wire();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match c_in.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    *a.lock().unwrap_or_else(|e| e.into_inner()) = (Instant::now(), true);
                    if s_out.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = s_out.shutdown(Shutdown::Write);
    });
    let (s_in, c_out) = (server, client);
    // The responses go server -> pipe -> client by `splice`: their bytes stay in the kernel
    // (the pages the server's socket received are handed on). Read into this thread and
    // written out again, the two copies were about a third of the proxy's time, and the
    // proxy a fifth of both CPUs, while a cold cache's working set was fetched (a profile
    // at f8653c5; the rest is the sockets' own work and the threads' wake-ups).
    let Ok(pipe) = Pipe::new() else {
        let _ = c_out.shutdown(Shutdown::Both);
        let _ = up.join();
        return;
    };
    loop {
        let n = match pipe.fill_from(&s_in, pipe.size) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let wait = {
            let mut g = asked.lock().unwrap_or_else(|e| e.into_inner());
            let w =
                g.1.then(|| (g.0 + first_byte).saturating_duration_since(Instant::now()));
            g.1 = false;
            w
        };
        if let Some(w) = wait.filter(|w| !w.is_zero()) {
            std::thread::sleep(w);
        }
        link.send(n);
        if pipe.drain_to(&c_out, n).is_err() {
            break;
        }
    }
    let _ = c_out.shutdown(Shutdown::Both);
    let _ = up.join();
}

/// One connection through a link of `half` a round trip each way ([`Proxy::start_rtt`]).
fn conn_rtt(client: TcpStream, upstream: SocketAddr, half: Duration) {
    as_the_wire();
    let Ok(server) = TcpStream::connect(upstream) else {
        return;
    };
    let _ = server.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let up = std::thread::spawn(move || relay(c2, s2, half));
    relay(server, client, half);
    let _ = up.join();
}

/// Bytes read from `from` delivered to `to` `half` after each was read: a reader that
/// never waits on the delivery (so that what comes during one wait is not held a second
/// one), and a writer that sleeps until each chunk is due.
fn relay(mut from: TcpStream, mut to: TcpStream, half: Duration) {
    // 1,024 chunks of at most 64 KiB in flight: a full link holds the reader back.
    let (tx, rx) = std::sync::mpsc::sync_channel::<(Instant, Vec<u8>)>(1024);
    let from_too = from.try_clone();
    let writer = std::thread::spawn(move || {
        as_the_wire();
        for (at, bytes) in rx {
            let due = at + half;
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if to.write_all(&bytes).is_err() {
                // The other side is gone: the reader is not left blocked on its socket.
                let _ = to.shutdown(Shutdown::Both);
                if let Ok(f) = &from_too {
                    let _ = f.shutdown(Shutdown::Both);
                }
                return;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
    as_the_wire();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.join();
    let _ = from.shutdown(Shutdown::Read);
}

/// What a response's pipe holds: a frame of 256 KiB moves in one `splice` in and one out,
/// and waits on the link once (the link takes it whole, as one packet of a queue: answers
/// in flight together leave one after another, where in pieces of 64 KiB theirs were
/// interleaved; a frame that comes behind N others waits about N frames' time either
/// way, as each connection holds one piece on the link at a time). In pieces of 64 KiB (Linux's default pipe) the proxy took
/// 0.095-0.107 s of CPU while a cold cache's working set (102.5 MiB) was fetched at 20 ms,
/// and 0.065-0.071 s in pieces of up to 1 MiB; the working set was read in 0.196 / 0.193 s
/// against 0.206 / 0.206 s, and 64 GETs at once delivered 710-732 MiB/s against
/// 633-637 (2 interleaved pairs of `--only cold+ws --latency-ms 20 --rounds 3`,
/// 2026-11-30).
const PIPE_BYTES: usize = 1 << 20;

/// A pipe that moves a response's bytes from one socket to another with `splice`.
struct Pipe {
    read: std::os::fd::OwnedFd,
    write: std::os::fd::OwnedFd,
    /// What it holds, bytes.
    size: usize,
}

impl Pipe {
    fn new() -> std::io::Result<Pipe> {
        use std::os::fd::FromRawFd;
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is two writable ints, as pipe2 takes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded: both are open descriptors this process owns alone.
        let (read, write) = unsafe {
            (
                std::os::fd::OwnedFd::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        };
        // SAFETY: F_SETPIPE_SZ takes an int; `write` is this pipe's open end.
        let got = unsafe {
            libc::fcntl(
                write.as_raw_fd(),
                libc::F_SETPIPE_SZ,
                PIPE_BYTES as libc::c_int,
            )
        };
        // Refused (a user without CAP_SYS_RESOURCE past pipe-max-size or past its pipes'
        // pages, pipe-user-pages-soft): what it holds as made.
        let size = match got {
            n if n > 0 => n as usize,
            // SAFETY: F_GETPIPE_SZ takes no argument; `write` is this pipe's open end.
            _ => unsafe { libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ) }.max(4096) as usize,
        };
        Ok(Pipe { read, write, size })
    }

    /// Moves at most `max` bytes (at most what the pipe holds) from `from` into the pipe,
    /// waiting for some; 0 at the end of `from`.
    fn fill_from(&self, from: &TcpStream, max: usize) -> std::io::Result<usize> {
        splice(from.as_raw_fd(), self.write.as_raw_fd(), max)
    }

    /// Moves all `n` bytes in the pipe to `to`.
    fn drain_to(&self, to: &TcpStream, mut n: usize) -> std::io::Result<()> {
        while n > 0 {
            match splice(self.read.as_raw_fd(), to.as_raw_fd(), n)? {
                0 => return Err(std::io::ErrorKind::WriteZero.into()),
                k => n -= k,
            }
        }
        Ok(())
    }
}

/// One `splice(2)` of at most `len` bytes, retried when interrupted.
fn splice(from: libc::c_int, to: libc::c_int, len: usize) -> std::io::Result<usize> {
    loop {
        // SAFETY: both are descriptors open for the call's length (owned by the caller's
        // sockets and pipe); null offsets: they are a socket and a pipe, read in order.
        let n = unsafe {
            libc::splice(
                from,
                std::ptr::null_mut(),
                to,
                std::ptr::null_mut(),
                len,
                libc::SPLICE_F_MOVE,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// This thread stands for the wire between two hosts, not for work on either: it runs as
/// soon as it wakes (SCHED_FIFO, the lowest real-time priority) and its sleeps end when
/// asked. Without it, on this 2-CPU host, the end of a first-byte wait queued behind the
/// hosts' own threads, and the proxy added more than the round trip it was told to.
fn as_the_wire() {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: both calls take plain values and change only this thread's scheduling (a
    // thread of its own that blocks in reads, writes and sleeps).
    unsafe {
        if libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) != 0 {
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
        }
    }
}
