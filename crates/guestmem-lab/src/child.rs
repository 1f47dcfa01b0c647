//! A child process the lab started (a page handler, a VMM): killed and reaped when dropped,
//! on every path, errors and panics included, so a scenario leaves no process behind.

use std::io;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Kills and reaps its process when dropped.
#[derive(Debug)]
pub(crate) struct Reaped(Child);

impl Reaped {
    /// Guards `child`.
    pub(crate) fn new(child: Child) -> Reaped {
        Reaped(child)
    }

    /// Its pid.
    pub(crate) fn id(&self) -> u32 {
        self.0.id()
    }

    /// Its exit status, if it has exited (reaped then).
    pub(crate) fn try_status(&mut self) -> io::Result<Option<ExitStatus>> {
        self.0.try_wait()
    }

    /// Kills and reaps it now (a no-op once reaped).
    pub(crate) fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Waits for it to exit by itself, at most `limit`.
    pub(crate) fn wait_exit(&mut self, limit: Duration) -> io::Result<ExitStatus> {
        let t = Instant::now();
        loop {
            if let Some(s) = self.0.try_wait()? {
                return Ok(s);
            }
            if t.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("process {} still running after {limit:?}", self.0.id()),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        self.kill();
    }
}
