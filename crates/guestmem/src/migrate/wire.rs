//! The move's control channel between the two hosts: one TCP connection from the source's
//! `guestmem move` to the destination's `guestmem move-in`, one JSON message a line, the
//! vmstate's bytes right after the message that announces them. Every read has a limit of
//! time and of size: nothing the other side sends is trusted unchecked.
//!
//! Each side first sends a [`Msg::Hello`]: the version it speaks, a nonce, and whether it
//! holds a move key. With a key on both sides, every message after the hellos is followed
//! by a line holding its MAC (and a payload by its MAC's 32 bytes), over the way it goes,
//! its place in the stream and its bytes ([`super::key::SessionKey`]); a message whose MAC
//! does not match ends the move. A key on one side only is refused by both.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::key::{MoveKey, SessionKey, Way};
use super::MoveError;

/// The longest message line (a manifest of 16 TiB of memory is far longer; a move's is the
/// manifest of one VM's memory: 4 MiB holds 16,000 frames' stacks).
pub(crate) const MAX_LINE_BYTES: u64 = 64 << 20;
/// The longest line read before the hellos (a hello is about 150 bytes; a refusal's reason
/// a few hundred).
const HELLO_LINE_BYTES: u64 = 16 << 10;
/// The most of the other side's reason kept, in characters.
const REASON_CHARS: usize = 1024;

/// `reason`, as the other side gave it, fit for a log line: at most [`REASON_CHARS`]
/// characters, control characters escaped.
fn shown(reason: &str) -> String {
    let mut out = String::new();
    for (i, c) in reason.chars().enumerate() {
        if i == REASON_CHARS {
            out.push_str(" [cut]");
            break;
        }
        match c.is_control() {
            true => out.extend(c.escape_default()),
            false => out.push(c),
        }
    }
    out
}

/// How long one send may block.
const SEND_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);
/// The largest payload accepted: a vmstate (Firecracker's is tens of KiB) or a manifest
/// (at most [`crate::store::MAX_MANIFEST_BYTES`]).
pub(crate) const MAX_PAYLOAD_BYTES: u64 = 64 << 20;

/// The version of these messages: both sides must speak the same one, which is known
/// before anything is paused (an Offer or a Ready without it, or with another, is refused).
pub(crate) const WIRE_VERSION: u32 = 4;

/// A connection idle this long is probed (TCP keepalive) ...
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
/// ... every this long ...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// ... and reset after this many probes go unanswered.
const KEEPALIVE_PROBES: u32 = 6;

/// One message.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "m", rename_all = "snake_case")]
pub(crate) enum Msg {
    /// Either side, first: the version it speaks, a nonce (64 hex digits, drawn for this
    /// connection), and whether it holds a move key.
    Hello {
        version: u32,
        nonce: String,
        keyed: bool,
    },
    /// Source: a VM restored from `base` wants to move; its diff's frames will be served at
    /// `peer`.
    Offer {
        version: u32,
        base: String,
        peer: String,
        name: String,
    },
    /// Destination: the base is readable here; pause when you like.
    Ready { version: u32 },
    /// Either side: no move, and why.
    Refused { reason: String },
    /// Source: the VM is paused; its vmstate (`vmstate_bytes` raw bytes follow this line),
    /// sent first so that the destination loads it while the source cuts its diff.
    State { vmstate_bytes: u64 },
    /// Source: the chain's manifest (the base's frames and the diff's; `manifest_bytes` raw
    /// bytes follow this line). `later`: the diff's pieces are named by placeholders
    /// (`store::name_later`), their hashes given by the store's manifest once pushed.
    Diff { manifest_bytes: u64, later: bool },
    /// Destination: the VM is loaded here, paused (`load_ms`: Firecracker's
    /// `snapshot/load` from the vmstate's arrival, `open_ms`: the chain checked and served
    /// from its arrival); it runs here once the source commits.
    Loaded { load_ms: f64, open_ms: f64 },
    /// Source: run it there; from now on the source never resumes its copy.
    Commit,
    /// Source: no move (the source resumes its copy); the destination ends its own.
    Abort { reason: String },
    /// Destination: the VM runs here.
    Running,
    /// Source: the diff is in the store as `url`.
    Pushed { url: String },
    /// Destination: it read `url`'s manifest, which names the frames it was owed, and no
    /// longer needs the source.
    Released,
}

/// A connection carrying [`Msg`]s.
pub(crate) struct Wire {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    peer: String,
    /// Once both hellos said so: this connection's key, and the way this side sends.
    mac: Option<(SessionKey, Way)>,
    /// Messages and payloads sent, and received, since the hellos.
    sent: u64,
    received: u64,
}

/// Which end of the connection a side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// The source (it connected, and says hello first).
    Source,
    /// The destination.
    Destination,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Source => "source",
            Side::Destination => "destination",
        }
    }

    fn other(self) -> &'static str {
        match self {
            Side::Source => "destination",
            Side::Destination => "source",
        }
    }
}

impl Wire {
    pub(crate) fn new(s: TcpStream) -> Result<Wire, MoveError> {
        let peer = s.peer_addr().map_or("?".into(), |a| a.to_string());
        let _ = s.set_nodelay(true);
        // Each side waits on the other without a limit at times (the source for the
        // destination's word after its commit, the destination for the push): a peer whose
        // host went away (no FIN, no RST) ends that wait within a minute and a half.
        let probed = crate::sys::tcp_keepalive(
            s.as_fd(),
            KEEPALIVE_IDLE,
            KEEPALIVE_INTERVAL,
            KEEPALIVE_PROBES,
        );
        if let Err(e) = probed {
            tracing::warn!(
                "move connection with {peer}: no TCP keepalive ({e}): a wait on it without a \
                 limit of its own ends only when the other side closes"
            );
        }
        let writer = s.try_clone().map_err(|e| MoveError::Wire {
            peer: peer.clone(),
            reason: e.to_string(),
        })?;
        // A stalled peer never holds a send (and so a pause) for ever: each send has one
        // deadline for the whole of it (`write_by`), not a timeout a write.
        writer
            .set_write_timeout(Some(SEND_LIMIT))
            .map_err(|e| MoveError::Wire {
                peer: peer.clone(),
                reason: e.to_string(),
            })?;
        Ok(Wire {
            reader: BufReader::new(s),
            writer,
            peer,
            mac: None,
            sent: 0,
            received: 0,
        })
    }

    /// The hellos, as `side`, waiting at most `limit` for the other's; with `key`, every
    /// message after them is MACed, and the returned session key gives the token for the
    /// source's frames. A version or a key on one side only is refused (and said to the
    /// other side) before anything else is sent.
    pub(crate) fn hello(
        &mut self,
        side: Side,
        key: Option<&MoveKey>,
        limit: Duration,
    ) -> Result<Option<SessionKey>, MoveError> {
        let ours = crate::sys::random_32().map_err(|e| self.err(format!("draw a nonce: {e}")))?;
        let hello = Msg::Hello {
            version: WIRE_VERSION,
            nonce: blake3::Hash::from_bytes(ours).to_hex().to_string(),
            keyed: key.is_some(),
        };
        if side == Side::Source {
            self.send(&hello, &[])?;
        }
        // Nothing is MACed yet: a line that could come from anyone is read short.
        let theirs = match self.recv_at_most(limit, HELLO_LINE_BYTES)? {
            Msg::Hello {
                version,
                nonce,
                keyed,
            } => {
                let nonce = blake3::Hash::from_hex(nonce.as_bytes()).ok();
                let why = match (version == WIRE_VERSION, nonce, keyed, key.is_some()) {
                    (false, ..) => Err(format!(
                        "the other side speaks move messages v{version}, this host v{WIRE_VERSION}; nothing paused"
                    )),
                    (true, None, ..) => Err("a hello without a nonce".into()),
                    (true, Some(_), true, false) => Err(format!(
                        "the {} holds a move key and this {} has none (--key-file on both hosts, or on neither); nothing paused",
                        side.other(), side.name()
                    )),
                    (true, Some(_), false, true) => Err(format!(
                        "this {} holds a move key and the {} has none (--key-file on both hosts, or on neither); nothing paused",
                        side.name(), side.other()
                    )),
                    (true, Some(n), ..) => Ok(*n.as_bytes()),
                };
                match why {
                    Ok(n) => n,
                    Err(reason) => return Err(self.refuse(self.err(reason))),
                }
            }
            Msg::Refused { reason } => {
                return Err(MoveError::Refused {
                    side: side.other(),
                    reason,
                })
            }
            Msg::Offer { version, .. } => {
                let e = self.err(format!(
                    "the other side speaks move messages v{version} (no hello), this host v{WIRE_VERSION}; nothing paused"
                ));
                return Err(self.refuse(e));
            }
            other => return Err(self.err(format!("expected a hello, got {other:?}"))),
        };
        if side == Side::Destination {
            self.send(&hello, &[])?;
        }
        let Some(key) = key else { return Ok(None) };
        let (session, way) = match side {
            Side::Source => (key.session(&ours, &theirs), Way::ToDestination),
            Side::Destination => (key.session(&theirs, &ours), Way::ToSource),
        };
        self.mac = Some((session.clone(), way));
        Ok(Some(session))
    }

    /// The MAC of the next message or payload this side sends.
    fn next_mac(&mut self, bytes: &[u8]) -> Option<[u8; 32]> {
        let (k, way) = self.mac.as_ref()?;
        let m = k.mac(*way, self.sent, bytes);
        self.sent += 1;
        Some(m)
    }

    /// Checks the MAC `got` of the next message or payload received, of `bytes`.
    fn check_mac(&mut self, what: &str, bytes: &[u8], got: &[u8]) -> Result<(), MoveError> {
        let Some((k, way)) = self.mac.as_ref() else {
            return Ok(());
        };
        let theirs = match way {
            Way::ToDestination => Way::ToSource,
            Way::ToSource => Way::ToDestination,
        };
        let want = k.mac(theirs, self.received, bytes);
        self.received += 1;
        match crate::store::same_bytes(&want, got) {
            true => Ok(()),
            false => Err(self.err(format!(
                "the {what} does not carry this move's MAC: the other side does not hold this move's key, or the message was changed on the way"
            ))),
        }
    }

    /// The other side's address.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    fn err(&self, reason: String) -> MoveError {
        MoveError::Wire {
            peer: self.peer.clone(),
            reason,
        }
    }

    /// Sends `m` (and `payload` right after it).
    pub(crate) fn send(&mut self, m: &Msg, payload: &[u8]) -> Result<(), MoveError> {
        let mut line = serde_json::to_vec(m).expect("a message serialises");
        line.push(b'\n');
        if let Some(mac) = self.next_mac(&line) {
            line.extend_from_slice(blake3::Hash::from_bytes(mac).to_hex().as_bytes());
            line.push(b'\n');
        }
        let payload_mac = match payload.is_empty() {
            true => None,
            false => self.next_mac(payload),
        };
        let deadline = Instant::now() + SEND_LIMIT;
        let mac = payload_mac.as_ref().map_or(&[][..], |m| m);
        write_by(&self.writer, &line, deadline)
            .and_then(|_| write_by(&self.writer, payload, deadline))
            .and_then(|_| write_by(&self.writer, mac, deadline))
            .map_err(|e| self.err(format!("send: {e}")))
    }

    /// Tells the other side no, and why (best effort: it may be gone); gives `e` back.
    /// (Within [`SEND_LIMIT`], as every send.)
    pub(crate) fn refuse(&mut self, e: MoveError) -> MoveError {
        let _ = self.send(
            &Msg::Refused {
                reason: e.to_string(),
            },
            &[],
        );
        e
    }

    /// Sets the socket's read timeout to what is left until `deadline`; `TimedOut` when
    /// nothing is.
    fn until(&self, deadline: Instant) -> std::io::Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        self.reader.get_ref().set_read_timeout(Some(left))
    }

    /// Waits, without a limit, until a message may be read (bytes came, or the connection
    /// closed: true) or `other` turns readable (false).
    pub(crate) fn wait_readable_or(
        &self,
        other: std::os::fd::BorrowedFd<'_>,
    ) -> Result<bool, MoveError> {
        if !self.reader.buffer().is_empty() {
            return Ok(true);
        }
        let mut fds = [
            crate::sys::PollFd::readable(self.reader.get_ref().as_fd()),
            crate::sys::PollFd::readable(other),
        ];
        crate::sys::poll(&mut fds, None).map_err(|e| self.err(format!("wait: {e}")))?;
        Ok(fds[0].revents() != 0)
    }

    /// [`Wire::recv`], unless `other` (when given) turns readable first: `None` then.
    pub(crate) fn recv_unless(
        &mut self,
        limit: Duration,
        other: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<Option<Msg>, MoveError> {
        if let (Some(other), true) = (other, self.reader.buffer().is_empty()) {
            let mut fds = [
                crate::sys::PollFd::readable(self.reader.get_ref().as_fd()),
                crate::sys::PollFd::readable(other),
            ];
            let n = crate::sys::poll(&mut fds, Some(limit))
                .map_err(|e| self.err(format!("wait: {e}")))?;
            if n > 0 && fds[1].ready() {
                return Ok(None);
            }
            if n == 0 {
                return Err(self.err(format!("no whole message within {limit:?}")));
            }
        }
        self.recv(limit).map(Some)
    }

    /// The next message, waiting at most `limit` for all of it: a peer that trickles a
    /// message out a byte at a time does not stretch the wait.
    pub(crate) fn recv(&mut self, limit: Duration) -> Result<Msg, MoveError> {
        self.recv_at_most(limit, MAX_LINE_BYTES)
    }

    /// [`Wire::recv`] of a line of at most `max` bytes.
    fn recv_at_most(&mut self, limit: Duration, max: u64) -> Result<Msg, MoveError> {
        let deadline = Instant::now() + limit;
        let line = self.line(deadline, limit, max)?;
        if self.mac.is_some() {
            // 64 hex digits and a newline: nothing longer is read before the check.
            let mac = self.line(deadline, limit, 65)?;
            let mac = blake3::Hash::from_hex(mac.trim_ascii_end()).map_err(|_| {
                self.err("a message without its MAC (the other side holds no move key?)".into())
            })?;
            self.check_mac("message", &line, mac.as_bytes())?;
        }
        let mut m: Msg = serde_json::from_slice(&line)
            .map_err(|e| self.err(format!("not a move message: {e}")))?;
        // The other side's words reach this host's log and errors: kept short, and
        // without a line break or a terminal's escape of their own.
        if let Msg::Refused { reason } | Msg::Abort { reason } = &mut m {
            *reason = shown(reason);
        }
        Ok(m)
    }

    /// One line, whole, by `deadline`, of at most `max` bytes.
    fn line(&mut self, deadline: Instant, limit: Duration, max: u64) -> Result<Vec<u8>, MoveError> {
        let mut line = Vec::new();
        let read = loop {
            if let Err(e) = self.until(deadline) {
                break Err(e);
            }
            let buf = match self.reader.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => break Err(e),
            };
            if buf.is_empty() {
                break Ok(());
            }
            let (n, done) = match buf.iter().position(|&c| c == b'\n') {
                Some(at) => (at + 1, true),
                None => (buf.len(), false),
            };
            line.extend_from_slice(&buf[..n]);
            self.reader.consume(n);
            if done || line.len() as u64 > max {
                break Ok(());
            }
        };
        read.map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                self.err(format!("no whole message within {limit:?}"))
            }
            _ => self.err(format!("receive: {e}")),
        })?;
        if line.is_empty() {
            return Err(self.err("closed the connection".into()));
        }
        if line.last() != Some(&b'\n') || line.len() as u64 > max {
            return Err(self.err(format!("a line longer than {max} bytes, or cut short")));
        }
        Ok(line)
    }

    /// `len` raw bytes (of `what`) that follow a message, all of them within `limit`.
    pub(crate) fn payload(
        &mut self,
        what: &str,
        len: u64,
        limit: Duration,
    ) -> Result<Vec<u8>, MoveError> {
        if len > MAX_PAYLOAD_BYTES {
            return Err(self.err(format!(
                "a {what} of {len} bytes, past the limit of {MAX_PAYLOAD_BYTES}"
            )));
        }
        let deadline = Instant::now() + limit;
        let tag = if self.mac.is_some() && len > 0 { 32 } else { 0 };
        let mut b = vec![0u8; len as usize + tag];
        let mut got = 0;
        while got < b.len() {
            let r = self
                .until(deadline)
                .and_then(|_| self.reader.read(&mut b[got..]));
            match r {
                Ok(0) => {
                    return Err(self.err(format!(
                        "the {what}'s {len} bytes: cut short at {}",
                        got.min(len as usize)
                    )))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(
                        self.err(format!("the {what}'s {len} bytes (within {limit:?}): {e}"))
                    )
                }
            }
        }
        if tag > 0 {
            let mac = b.split_off(len as usize);
            self.check_mac(what, &b, &mac)?;
        }
        Ok(b)
    }
}

/// Writes all of `buf` to `s` by `deadline`: a peer that takes a few bytes now and then
/// (each write's own timeout met) cannot stretch a send, and a pause, past it.
fn write_by(mut s: &TcpStream, mut buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("not sent within {SEND_LIMIT:?}"),
            ));
        }
        s.set_write_timeout(Some(left))?;
        match s.write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A move's connection is probed when idle (TCP keepalive, and a limit on data left
    /// unacknowledged): the waits without a limit (the source's for the destination's word
    /// after its commit, the destination's for the push) end when the other host went away
    /// without closing. Before 2026-11-29 they waited for ever.
    #[test]
    fn a_moves_connection_is_probed_when_idle() {
        use std::os::fd::AsRawFd;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let w = Wire::new(c).unwrap();
        let get = |level, opt| {
            let mut v: libc::c_int = 0;
            let mut n = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: an int option written to our stack, on a socket the wire owns.
            let r = unsafe {
                libc::getsockopt(
                    w.writer.as_raw_fd(),
                    level,
                    opt,
                    &mut v as *mut libc::c_int as *mut libc::c_void,
                    &mut n,
                )
            };
            assert_eq!(r, 0);
            v
        };
        assert_eq!(get(libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 30);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 10);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 6);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT), 90_000);
    }

    /// A peer that reads a little now and then (each write's own timeout met) cannot
    /// stretch a send past its deadline: here 64 MiB to a reader of 200 KiB/s, which a
    /// timeout a write would have let run for minutes, fails at its half second.
    #[test]
    fn a_slow_reader_cannot_stretch_a_send() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let w = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut r, _) = l.accept().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        let reader = std::thread::spawn(move || {
            let mut b = [0u8; 4096];
            while !stopped.load(std::sync::atomic::Ordering::Relaxed)
                && r.read(&mut b).is_ok_and(|n| n > 0)
            {
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let big = vec![0u8; 64 << 20];
        let e = write_by(&w, &big, Instant::now() + Duration::from_millis(500)).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ),
            "{e}"
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        reader.join().unwrap();
    }

    /// A connected pair: our `Wire` and the other side's raw stream.
    fn pair() -> (Wire, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let other = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (ours, _) = l.accept().unwrap();
        (Wire::new(ours).unwrap(), other)
    }

    #[test]
    fn a_message_trickled_out_a_byte_at_a_time_does_not_stretch_the_limit() {
        let (mut wire, mut other) = pair();
        let line = b"{\"m\":\"running\"}\n".to_vec();
        // One byte every 100 ms: the whole line would take 1.7 s; the limit is 300 ms.
        let trickle = std::thread::spawn(move || {
            for c in line {
                if other.write_all(&[c]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let e = wire
            .recv(Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no whole message within"), "{e}");
        drop(wire);
        trickle.join().unwrap();
    }

    #[test]
    fn messages_and_payloads_arrive_whole_in_any_pieces() {
        let (mut wire, mut other) = pair();
        let payload: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut bytes = b"{\"m\":\"state\",\"vmstate_bytes\":100000}\n".to_vec();
        bytes.extend_from_slice(&payload);
        bytes.extend_from_slice(b"{\"m\":\"commit\"}\n");
        let send = std::thread::spawn(move || {
            for piece in bytes.chunks(7919) {
                other.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
            other
        });
        let limit = Duration::from_secs(20);
        match wire.recv(limit).unwrap() {
            Msg::State { vmstate_bytes } => {
                assert_eq!(
                    wire.payload("vmstate", vmstate_bytes, limit).unwrap(),
                    payload
                )
            }
            m => panic!("{m:?}"),
        }
        assert!(matches!(wire.recv(limit).unwrap(), Msg::Commit));
        drop(send.join().unwrap());
        // The other side gone: said so.
        let e = wire.recv(limit).unwrap_err().to_string();
        assert!(e.contains("closed"), "{e}");
    }

    /// Two `Wire`s connected to each other: (source, destination).
    fn wires() -> (Wire, Wire) {
        let (dst, src) = pair();
        (Wire::new(src).unwrap(), dst)
    }

    /// The hellos on both sides at once: each side's result.
    fn hellos(
        src: &mut Wire,
        dst: &mut Wire,
        ks: Option<&MoveKey>,
        kd: Option<&MoveKey>,
    ) -> (Result<bool, String>, Result<bool, String>) {
        let limit = Duration::from_secs(10);
        std::thread::scope(|sc| {
            let d = sc.spawn(|| dst.hello(Side::Destination, kd, limit));
            let s = src.hello(Side::Source, ks, limit);
            let d = d.join().unwrap();
            let r = |x: Result<Option<SessionKey>, MoveError>| {
                x.map(|k| k.is_some()).map_err(|e| e.to_string())
            };
            (r(s), r(d))
        })
    }

    /// Before the hellos a line is read short, and a refusal's reason from the other
    /// side is kept short and escaped wherever it comes.
    #[test]
    fn the_other_sides_words_are_read_short_and_shown_escaped() {
        use std::io::Write;
        let (mut dst, mut src) = pair();
        src.write_all(&vec![b'x'; (HELLO_LINE_BYTES + 10) as usize])
            .unwrap();
        src.write_all(b"\n").unwrap();
        let e = dst
            .hello(Side::Destination, None, Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        assert!(e.contains("a line longer than 16384 bytes"), "{e}");

        let (mut dst, src) = pair();
        let mut src = Wire::new(src).unwrap();
        let reason = format!("no\n2026 FAKE LOG LINE\x1b[31m{}", "y".repeat(5000));
        src.send(&Msg::Refused { reason }, &[]).unwrap();
        let e = dst
            .hello(Side::Destination, None, Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        assert!(
            !e.contains('\n')
                && !e.contains('\x1b')
                && e.contains("no\\n2026")
                && e.ends_with("[cut]"),
            "{e}"
        );
        assert!(e.len() < 1400, "{}", e.len());
    }

    /// A wait that another descriptor may end: a message there is read; the other turned
    /// readable ends it with none; neither within the limit is an error.
    #[test]
    fn a_wait_for_a_message_ends_when_asked_to() {
        use std::os::fd::AsFd;
        let (mut dst, src) = pair();
        let mut src = Wire::new(src).unwrap();
        let stop = crate::sys::eventfd().unwrap();
        let limit = Duration::from_millis(300);
        let e = dst.recv_unless(limit, Some(stop.as_fd())).unwrap_err();
        assert!(e.to_string().contains("no whole message"), "{e}");
        src.send(&Msg::Commit, &[]).unwrap();
        let got = dst.recv_unless(Duration::from_secs(10), Some(stop.as_fd()));
        assert!(matches!(got, Ok(Some(Msg::Commit))), "{got:?}");
        crate::sys::eventfd_signal(stop.as_fd()).unwrap();
        let t0 = Instant::now();
        let got = dst.recv_unless(Duration::from_secs(30), Some(stop.as_fd()));
        assert!(matches!(got, Ok(None)), "{got:?}");
        assert!(t0.elapsed() < Duration::from_secs(10));
    }

    fn key(b: u8) -> MoveKey {
        MoveKey::from_secret(&[b; 32]).unwrap()
    }

    /// Two `Wire`s whose hellos passed with `k`: (source, destination).
    fn keyed(k: &MoveKey) -> (Wire, Wire) {
        let (mut src, mut dst) = wires();
        assert_eq!(
            hellos(&mut src, &mut dst, Some(k), Some(k)),
            (Ok(true), Ok(true))
        );
        (src, dst)
    }

    /// `m`'s line and its MAC line, as `w` would send them next (its counter moved on).
    fn macd(w: &mut Wire, m: &Msg) -> Vec<u8> {
        let mut l = serde_json::to_vec(m).unwrap();
        l.push(b'\n');
        let mac = w.next_mac(&l).unwrap();
        l.extend_from_slice(blake3::Hash::from_bytes(mac).to_hex().as_bytes());
        l.push(b'\n');
        l
    }

    #[test]
    fn with_one_key_messages_and_payloads_go_both_ways_macd() {
        let (mut src, mut dst) = wires();
        let k = key(1);
        assert_eq!(
            hellos(&mut src, &mut dst, Some(&k), Some(&k)),
            (Ok(true), Ok(true))
        );
        let limit = Duration::from_secs(10);
        src.send(&Msg::State { vmstate_bytes: 5 }, b"hello")
            .unwrap();
        src.send(&Msg::Commit, &[]).unwrap();
        assert!(matches!(
            dst.recv(limit).unwrap(),
            Msg::State { vmstate_bytes: 5 }
        ));
        assert_eq!(dst.payload("vmstate", 5, limit).unwrap(), b"hello");
        assert!(matches!(dst.recv(limit).unwrap(), Msg::Commit));
        dst.send(&Msg::Running, &[]).unwrap();
        assert!(matches!(src.recv(limit).unwrap(), Msg::Running));
    }

    #[test]
    fn another_key_is_caught_at_the_first_message_and_a_key_on_one_side_only_at_the_hello() {
        // Other keys: the hellos pass, the first message does not.
        let (mut src, mut dst) = wires();
        assert_eq!(
            hellos(&mut src, &mut dst, Some(&key(1)), Some(&key(2))),
            (Ok(true), Ok(true))
        );
        src.send(&Msg::Commit, &[]).unwrap();
        let e = dst.recv(Duration::from_secs(10)).unwrap_err().to_string();
        assert!(e.contains("does not carry this move's MAC"), "{e}");
        // A key on one side only: both say so.
        for (ks, kd) in [(Some(key(1)), None), (None, Some(key(1)))] {
            let (mut src, mut dst) = wires();
            let (s, d) = hellos(&mut src, &mut dst, ks.as_ref(), kd.as_ref());
            for e in [s.unwrap_err(), d.unwrap_err()] {
                assert!(e.contains("move key") && e.contains("--key-file"), "{e}");
            }
        }
        // Neither: the move goes on unauthenticated.
        let (mut src, mut dst) = wires();
        assert_eq!(
            hellos(&mut src, &mut dst, None, None),
            (Ok(false), Ok(false))
        );
    }

    #[test]
    fn a_message_changed_replayed_or_sent_back_is_refused() {
        let limit = Duration::from_secs(10);
        let k = key(3);
        // Changed on the way: a byte of the line, then of a payload.
        for payload in [false, true] {
            let (mut src, mut dst) = wires();
            assert_eq!(
                hellos(&mut src, &mut dst, Some(&k), Some(&k)),
                (Ok(true), Ok(true))
            );
            let (line, mac) = {
                let mut l = serde_json::to_vec(&Msg::State { vmstate_bytes: 3 }).unwrap();
                l.push(b'\n');
                let m = src.next_mac(&l).unwrap();
                (l, m)
            };
            let pm = src.next_mac(b"abc").unwrap();
            let mut raw = line.clone();
            if !payload {
                raw[10] ^= 1;
            }
            raw.extend_from_slice(blake3::Hash::from_bytes(mac).to_hex().as_bytes());
            raw.push(b'\n');
            raw.extend_from_slice(if payload { b"abd" } else { b"abc" });
            raw.extend_from_slice(&pm);
            src.writer.write_all(&raw).unwrap();
            let got = dst
                .recv(limit)
                .and_then(|_| dst.payload("vmstate", 3, limit));
            let e = got.unwrap_err().to_string();
            assert!(e.contains("MAC"), "{payload}: {e}");
        }
        // Replayed: the same message, whole, twice.
        let (mut src, mut dst) = keyed(&k);
        let l = macd(&mut src, &Msg::Commit);
        src.writer.write_all(&l).unwrap();
        src.writer.write_all(&l).unwrap();
        assert!(matches!(dst.recv(limit).unwrap(), Msg::Commit));
        assert!(dst.recv(limit).unwrap_err().to_string().contains("MAC"));
        // No MAC at all, to a side that holds a key.
        let (mut src, mut dst) = keyed(&k);
        src.writer
            .write_all(b"{\"m\":\"commit\"}\n{\"m\":\"running\"}\n")
            .unwrap();
        let e = dst.recv(limit).unwrap_err().to_string();
        assert!(e.contains("without its MAC"), "{e}");
        // Sent back: a MAC made for the other way.
        let (mut src, mut dst) = keyed(&k);
        let l = macd(&mut src, &Msg::Running);
        dst.writer.write_all(&l).unwrap();
        assert!(src.recv(limit).unwrap_err().to_string().contains("MAC"));
    }
}
