//! The move's control channel between the two hosts: one TCP connection from the source's
//! `guestmem move` to the destination's `guestmem move-in`, one JSON message a line, the
//! vmstate's bytes right after the message that announces them. Every read has a limit of
//! time and of size: nothing the other side sends is trusted unchecked.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::MoveError;

/// The longest message line (a manifest of 16 TiB of memory is far longer; a move's is the
/// manifest of one VM's memory: 4 MiB holds 16,000 frames' stacks).
pub(crate) const MAX_LINE_BYTES: u64 = 64 << 20;
/// How long one send may block.
const SEND_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);
/// The largest payload accepted: a vmstate (Firecracker's is tens of KiB) or a manifest
/// (at most [`crate::store::MAX_MANIFEST_BYTES`]).
pub(crate) const MAX_PAYLOAD_BYTES: u64 = 64 << 20;

/// The version of these messages: both sides must speak the same one, which is known
/// before anything is paused (an Offer or a Ready without it, or with another, is refused).
pub(crate) const WIRE_VERSION: u32 = 3;

/// One message.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "m", rename_all = "snake_case")]
pub(crate) enum Msg {
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
}

impl Wire {
    pub(crate) fn new(s: TcpStream) -> Result<Wire, MoveError> {
        let peer = s.peer_addr().map_or("?".into(), |a| a.to_string());
        let _ = s.set_nodelay(true);
        let writer = s.try_clone().map_err(|e| MoveError::Wire {
            peer: peer.clone(),
            reason: e.to_string(),
        })?;
        // A stalled peer never holds a send (and so a pause) for ever.
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
        })
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
        self.writer
            .write_all(&line)
            .and_then(|_| self.writer.write_all(payload))
            .and_then(|_| self.writer.flush())
            .map_err(|e| self.err(format!("send: {e}")))
    }

    /// Tells the other side no, and why (best effort: it may be gone); gives `e` back.
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

    /// The next message, waiting at most `limit` for all of it: a peer that trickles a
    /// message out a byte at a time does not stretch the wait.
    pub(crate) fn recv(&mut self, limit: Duration) -> Result<Msg, MoveError> {
        let deadline = Instant::now() + limit;
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
            if done || line.len() as u64 > MAX_LINE_BYTES {
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
        if line.last() != Some(&b'\n') || line.len() as u64 > MAX_LINE_BYTES {
            return Err(self.err(format!(
                "a message longer than {MAX_LINE_BYTES} bytes, or cut short"
            )));
        }
        serde_json::from_slice(&line).map_err(|e| self.err(format!("not a move message: {e}")))
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
        let mut b = vec![0u8; len as usize];
        let mut got = 0;
        while got < b.len() {
            let r = self
                .until(deadline)
                .and_then(|_| self.reader.read(&mut b[got..]));
            match r {
                Ok(0) => {
                    return Err(self.err(format!("the {what}'s {len} bytes: cut short at {got}")))
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
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

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
}
