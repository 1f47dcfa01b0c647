//! The move's control channel between the two hosts: one TCP connection from the source's
//! `guestmem move` to the destination's `guestmem move-in`, one JSON message a line, the
//! vmstate's bytes right after the message that announces them. Every read has a limit of
//! time and of size: nothing the other side sends is trusted unchecked.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

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
pub(crate) const WIRE_VERSION: u32 = 2;

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
    /// bytes follow this line).
    Diff { manifest_bytes: u64 },
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

    /// The next message, waiting at most `limit`.
    pub(crate) fn recv(&mut self, limit: Duration) -> Result<Msg, MoveError> {
        self.reader
            .get_ref()
            .set_read_timeout(Some(limit))
            .map_err(|e| self.err(e.to_string()))?;
        let mut line = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE_BYTES + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    self.err(format!("no message within {limit:?}"))
                }
                _ => self.err(format!("receive: {e}")),
            })?;
        if n == 0 {
            return Err(self.err("closed the connection".into()));
        }
        if line.last() != Some(&b'\n') {
            return Err(self.err(format!(
                "a message longer than {MAX_LINE_BYTES} bytes, or cut short"
            )));
        }
        serde_json::from_slice(&line).map_err(|e| self.err(format!("not a move message: {e}")))
    }

    /// `len` raw bytes (of `what`) that follow a message.
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
        self.reader
            .get_ref()
            .set_read_timeout(Some(limit))
            .map_err(|e| self.err(e.to_string()))?;
        let mut b = vec![0u8; len as usize];
        self.reader
            .read_exact(&mut b)
            .map_err(|e| self.err(format!("the {what}'s {len} bytes: {e}")))?;
        Ok(b)
    }
}
