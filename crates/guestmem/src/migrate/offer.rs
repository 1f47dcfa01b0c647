//! The destination's wait for a move: connections heard at once until one says hello and
//! offers a move in time.

use std::net::TcpListener;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::wire::{Msg, Side, Wire};
use super::MoveError;

/// How long a connection has to say hello and offer its move before it is dropped (a
/// source does both as it connects).
const HELLO_LIMIT: Duration = Duration::from_secs(10);
/// Connections heard at once: past it, new ones wait in the listen backlog until one of
/// these is done. Each is heard on a thread of its own for at most [`HELLO_LIMIT`].
const HEARD_AT_ONCE: usize = 16;

/// What a source that offered a move left: the connection, the read token and piece key
/// drawn from the move key (none without one), and its offer.
pub(super) type Offered = (Wire, Option<(String, [u8; 32])>, Msg);

/// Takes connections on `listener` until one says hello (proving it holds `key`, where
/// there is one) and offers a move, within `wait` in all, or `stop` turns readable.
pub(super) fn first_offer(
    listener: &TcpListener,
    wait: Duration,
    key: Option<&super::MoveKey>,
    stop: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<Offered, MoveError> {
    // Each connection is heard on a thread of its own, for its hello and offer within
    // HELLO_LIMIT (MACed when keyed): one that connects and says nothing, or the wrong
    // thing, is dropped, and holds no other up (until 2026-11-29 they were heard in turn,
    // so each silent one kept the real source waiting up to HELLO_LIMIT). The first offer
    // wins; the others' threads end by their limit, their connections closed.
    let until = Instant::now() + wait;
    let where_ = || -> std::path::PathBuf {
        listener
            .local_addr()
            .map_or("?".into(), |a| a.to_string())
            .into()
    };
    let done = Arc::new(crate::sys::eventfd().map_err(|source| MoveError::Io {
        op: "make an eventfd to wait for a move on",
        path: where_(),
        source,
    })?);
    let (tx, rx) = mpsc::channel::<Offered>();
    let heard = Arc::new(AtomicUsize::new(0));
    loop {
        if let Ok(offered) = rx.try_recv() {
            return Ok(offered);
        }
        let left = until.saturating_duration_since(Instant::now());
        // At the cap, new connections wait in the listen backlog until a thread is free
        // (each is at most HELLO_LIMIT): none is closed unheard.
        let room = heard.load(Ordering::Acquire) < HEARD_AT_ONCE;
        let mut fds = [
            crate::sys::PollFd::readable(match room {
                true => listener.as_fd(),
                false => done.as_fd(),
            }),
            crate::sys::PollFd::readable(done.as_fd()),
            crate::sys::PollFd::readable(stop.unwrap_or(done.as_fd())),
        ];
        let ready = crate::sys::poll(&mut fds, Some(left)).map_err(|e| MoveError::Io {
            op: "wait for a move on",
            path: where_(),
            source: e,
        })?;
        if stop.is_some_and(crate::sys::is_readable) {
            return Err(MoveError::Refused {
                side: "destination",
                reason: "asked to stop while waiting for a source; nothing moved".into(),
            });
        }
        if ready == 0 {
            if let Ok(offered) = rx.try_recv() {
                return Ok(offered);
            }
            return Err(MoveError::Wire {
                peer: "(none)".into(),
                reason: format!("no source connected within {wait:?}"),
            });
        }
        if fds[1].ready() {
            let _ = crate::sys::eventfd_read(done.as_fd());
            continue;
        }
        let s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!("move: accept failed: {e}");
                // Out of descriptors, say: the listener stays readable, so wait a little
                // rather than spin.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let _ = s.set_nonblocking(false);
        let by = Instant::now() + HELLO_LIMIT.min(until.saturating_duration_since(Instant::now()));
        heard.fetch_add(1, Ordering::AcqRel);
        let (tx, signal, count, key) = (
            tx.clone(),
            Arc::clone(&done),
            Arc::clone(&heard),
            key.cloned(),
        );
        let spawned = std::thread::Builder::new()
            .name("guestmem-move-hello".into())
            .spawn(move || {
                if let Some(offered) = hear(s, key.as_ref(), by) {
                    // Sent first, then signalled: the waiting side reads the channel once
                    // woken. (Gone: another offer won, and this connection closes.)
                    let _ = tx.send(offered);
                }
                // Then a thread free: the waiting side looks at the listener again.
                count.fetch_sub(1, Ordering::AcqRel);
                let _ = crate::sys::eventfd_signal(signal.as_fd());
            });
        if let Err(e) = spawned {
            tracing::warn!("move: no thread to hear a connection on: {e}");
            heard.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One connection's hello and offer, by `by`; `None` (said in the log) when it gave neither.
fn hear(s: std::net::TcpStream, key: Option<&super::MoveKey>, by: Instant) -> Option<Offered> {
    let mut wire = match Wire::new(s) {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!("move: dropped a connection: {e}");
            return None;
        }
    };
    // One limit for the hello and the offer both.
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
            return None;
        }
    };
    match wire.recv(left()) {
        Ok(offer) => Some((wire, token, offer)),
        Err(e) => {
            let peer = wire.peer().to_string();
            let e = wire.refuse(e);
            tracing::warn!("move: dropped a connection from {peer}: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;

    /// A source that connects, says hello with `key` and offers `name`.
    fn source(
        addr: std::net::SocketAddr,
        key: super::super::MoveKey,
        name: &'static str,
    ) -> std::thread::JoinHandle<Result<(), MoveError>> {
        // Held open until the destination is done with it (its next message, or the close).
        std::thread::spawn(move || {
            let mut w = Wire::new(TcpStream::connect(addr).unwrap())?;
            w.hello(Side::Source, Some(&key), HELLO_LIMIT)?;
            w.send(
                &Msg::Offer {
                    version: super::super::wire::WIRE_VERSION,
                    base: "s3://snaps/base".into(),
                    peer: "http://127.0.0.1:1".into(),
                    name: name.into(),
                },
                &[],
            )?;
            let _ = w.recv(HELLO_LIMIT);
            Ok(())
        })
    }

    /// Connections that say nothing, or the wrong key, are heard beside the real source:
    /// its offer is taken at once, not after each of theirs has had its limit.
    #[test]
    fn a_connection_that_says_nothing_does_not_hold_the_source_up() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let key = super::super::MoveKey::from_secret(&[7u8; 32]).unwrap();
        let silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let wrong = source(
            addr,
            super::super::MoveKey::from_secret(&[8u8; 32]).unwrap(),
            "wrong",
        );
        let real = source(addr, key.clone(), "moved");
        let t0 = Instant::now();
        let (wire, token, offer) =
            first_offer(&l, Duration::from_secs(60), Some(&key), None).unwrap();
        assert!(
            t0.elapsed() < HELLO_LIMIT,
            "the offer waited {:?}, behind the silent connections",
            t0.elapsed()
        );
        assert!(token.is_some());
        match offer {
            Msg::Offer { name, .. } => assert_eq!(name, "moved"),
            other => panic!("{other:?}"),
        }
        drop(wire);
        real.join().unwrap().unwrap();
        let _ = wrong.join().unwrap();
        drop(silent);
    }

    /// Past the connections heard at once, the next waits in the backlog (not closed) and
    /// is heard as soon as one of those is done.
    #[test]
    fn past_the_cap_a_source_waits_its_turn_and_is_heard() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let key = super::super::MoveKey::from_secret(&[9u8; 32]).unwrap();
        let mut silent: Vec<TcpStream> = (0..HEARD_AT_ONCE)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let waiter = std::thread::spawn({
            let key = key.clone();
            move || {
                let got = first_offer(&l, Duration::from_secs(30), Some(&key), None);
                got.map(|(_, _, offer)| offer)
            }
        });
        // Every silent one taken before the source connects, then one lets go.
        std::thread::sleep(Duration::from_millis(300));
        let real = source(addr, key, "turn");
        std::thread::sleep(Duration::from_millis(300));
        let t0 = Instant::now();
        silent.pop();
        match waiter.join().unwrap() {
            Ok(Msg::Offer { name, .. }) => assert_eq!(name, "turn"),
            other => panic!("{other:?}"),
        }
        assert!(t0.elapsed() < HELLO_LIMIT, "{:?}", t0.elapsed());
        let _ = real.join().unwrap();
        drop(silent);
    }

    /// Asked to stop while waiting, the wait ends at once, saying so.
    #[test]
    fn a_wait_asked_to_stop_ends_at_once() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let stop = crate::sys::eventfd().unwrap();
        let t0 = Instant::now();
        let asker = {
            let stop = stop.try_clone().unwrap();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                crate::sys::eventfd_signal(stop.as_fd()).unwrap();
            })
        };
        let e = first_offer(&l, Duration::from_secs(60), None, Some(stop.as_fd()))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("asked to stop"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        asker.join().unwrap();
    }

    /// With no source, the wait ends at its limit, naming it.
    #[test]
    fn no_source_in_time_is_said() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let _silent = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let e = first_offer(&l, Duration::from_millis(300), None, None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("no source connected within 300ms"), "{e}");
    }
}
