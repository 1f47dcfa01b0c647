//! A Firecracker process's API, as a move drives it: one HTTP/1.1 request a connection on
//! its unix socket (as `curl --unix-socket` sends them), and the process itself, held by a
//! pidfd taken from the socket's peer (`SO_PEERPIDFD`), so that ending it can never signal
//! another process that took its pid.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::MoveError;
use crate::serve::PeerProcess;

/// Firecracker's API on its unix socket.
#[derive(Debug)]
pub(crate) struct Api {
    path: PathBuf,
    /// What the move calls it in messages (`source` or `destination`).
    side: &'static str,
}

impl Api {
    /// The API at `path`, and the process that answers there.
    pub(crate) fn open(path: &Path, side: &'static str) -> Result<(Api, PeerProcess), MoveError> {
        let api = Api {
            path: path.to_path_buf(),
            side,
        };
        let s = UnixStream::connect(path).map_err(|e| api.err("connect to", e.to_string()))?;
        let process = PeerProcess::of(&s);
        if !process.can_signal() {
            return Err(api.err(
                "hold the process of",
                "no pidfd for the socket's peer (needs Linux 6.5, SO_PEERPIDFD)".into(),
            ));
        }
        Ok((api, process))
    }

    fn err(&self, what: &str, reason: String) -> MoveError {
        MoveError::Firecracker {
            side: self.side,
            request: format!("{what} {}", self.path.display()),
            reason,
        }
    }

    /// One request that must succeed (2xx), at most `limit`; the body of the answer.
    pub(crate) fn ok(
        &self,
        method: &str,
        path: &str,
        body: &str,
        limit: Duration,
    ) -> Result<String, MoveError> {
        let request = format!("{method} /{path}");
        let fail = |reason: String| MoveError::Firecracker {
            side: self.side,
            request: request.clone(),
            reason,
        };
        match self.call(method, path, body, limit) {
            Ok((200..=299, text)) => Ok(text),
            Ok((code, text)) => Err(fail(format!("HTTP {code}: {}", text.trim()))),
            Err(e) => Err(fail(e.to_string())),
        }
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: &str,
        limit: Duration,
    ) -> io::Result<(u16, String)> {
        let mut s = UnixStream::connect(&self.path)?;
        s.set_read_timeout(Some(limit))?;
        s.set_write_timeout(Some(limit))?;
        write!(
            s,
            "{method} /{path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Accept: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut reader = BufReader::new(s);
        let mut status = String::new();
        reader.read_line(&mut status)?;
        let code = status
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| io::Error::other(format!("no HTTP status line: {status:?}")))?;
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        // An answer's body is a short JSON message; anything longer is cut, not read.
        let mut b = vec![0u8; len.min(64 << 10)];
        reader.read_exact(&mut b)?;
        Ok((code, String::from_utf8_lossy(&b).into_owned()))
    }
}

/// A JSON string literal of a path (Firecracker's API takes paths in JSON bodies).
pub(crate) fn json_path(p: &Path) -> String {
    serde_json::to_string(&p.to_string_lossy()).expect("a string serialises")
}
