//! The destination's wait for a move: connections taken until one says hello and offers a
//! move in time.

use std::net::TcpListener;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use super::wire::{Msg, Side, Wire};
use super::MoveError;

/// How long a connection has to say hello and offer its move before it is dropped for
/// the next (a source does both as it connects).
const HELLO_LIMIT: Duration = Duration::from_secs(10);

/// What a source that offered a move left: the connection, the read token and piece key
/// drawn from the move key (none without one), and its offer.
pub(super) type Offered = (Wire, Option<(String, [u8; 32])>, Msg);

/// Takes connections on `listener` until one says hello (proving it holds `key`, where
/// there is one) and offers a move, within `wait` in all.
pub(super) fn first_offer(
    listener: &TcpListener,
    wait: Duration,
    key: Option<&super::MoveKey>,
) -> Result<Offered, MoveError> {
    // Connections are taken until one says hello and offers a move within HELLO_LIMIT
    // (MACed when keyed): one that connects first and says nothing, or the wrong thing,
    // is dropped, and cannot keep the real source waiting past its own limits.
    let until = Instant::now() + wait;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let mut fds = [crate::sys::PollFd::readable(listener.as_fd())];
        let ready = crate::sys::poll(&mut fds, Some(left)).map_err(|e| MoveError::Io {
            op: "wait for a move on",
            path: listener
                .local_addr()
                .map_or("?".into(), |a| a.to_string())
                .into(),
            source: e,
        })?;
        let (s, _) = match ready {
            0 => {
                return Err(MoveError::Wire {
                    peer: "(none)".into(),
                    reason: format!("no source connected within {wait:?}"),
                })
            }
            _ => match listener.accept() {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("move: accept failed: {e}");
                    // Out of descriptors, say: the listener stays readable, so wait a
                    // little rather than spin.
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    continue;
                }
            },
        };
        let _ = s.set_nonblocking(false);
        let mut wire = Wire::new(s)?;
        // One limit for the hello and the offer both: a connection that says nothing
        // holds the next one up HELLO_LIMIT, not twice that.
        let by = Instant::now() + HELLO_LIMIT.min(until.saturating_duration_since(Instant::now()));
        let left = || by.saturating_duration_since(Instant::now());
        let token = match wire.hello(Side::Destination, key, left()) {
            Ok(Some(session)) => Some((session.read_token(), session.piece_key())),
            Ok(None) => {
                tracing::warn!(
                    "a move from {} without a move key: the source is not authenticated (docs/move.md, Security)",
                    wire.peer()
                );
                None
            }
            Err(e) => {
                tracing::warn!("move: dropped a connection from {}: {e}", wire.peer());
                continue;
            }
        };
        match wire.recv(left()) {
            Ok(offer) => return Ok((wire, token, offer)),
            Err(e) => {
                let peer = wire.peer().to_string();
                let e = wire.refuse(e);
                tracing::warn!("move: dropped a connection from {peer}: {e}");
            }
        }
    }
}
