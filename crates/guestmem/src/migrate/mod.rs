//! Moving a running Firecracker VM to another host with a pause of milliseconds.
//!
//! The VM was restored from a snapshot in the store (`s3://BUCKET/BASE`) with dirty-page
//! tracking on, so at the pause only what it wrote since is moved:
//!
//! 1. [`move_out`] on the source host offers the move to [`move_in`] on the destination,
//!    which reads the base's manifest and says it is ready (or refuses: nothing is paused).
//! 2. The source pauses the VM and has Firecracker write a `Diff` snapshot (vmstate and a
//!    sparse memory file of the pages written). It cuts the diff into frames in the store's
//!    format (hashed, kept in memory, served over HTTP by a [`crate::store::PeerServer`])
//!    and sends the chain's manifest and the vmstate to the destination.
//! 3. The destination serves the chain with its page server (the base's frames from its
//!    cache or the store, the diff's from the source, on one fetch path: flights, hash
//!    checks, retries, the deadline), loads the vmstate into its Firecracker through the
//!    `Uffd` backend with `resume_vm`, and says the VM runs. The pause ends there.
//! 4. The source ends its Firecracker (through a pidfd), pushes the diff to the store as a
//!    layer on the base (manifest last), and tells the destination, which reads that
//!    manifest, checks it names the frames it was owed, and stops needing the source.
//!
//! The window of risk is from the pause to that release: losing the source inside it ends
//! the VM (after the fetch deadline, with the reason logged; never a zero page). A failure
//! before the destination runs resumes the VM on the source.
//!
//! With a [`MoveKey`] on both hosts, the two prove they hold it at connect time, every
//! control message is MACed, the source's frames are served only to requests with the
//! connection's token, and the pieces it serves under placeholders are sealed (the `key`
//! module). Nothing is encrypted.

mod chain;
#[cfg(test)]
mod failed;
mod firecracker;
mod into;
mod key;
mod offer;
mod out;
mod owed;
mod ready;
mod wire;

pub use into::{move_in, MoveIn, MoveInReport};
pub use key::{MoveKey, MAX_KEY_BYTES, MIN_KEY_BYTES};
pub use out::{move_out, MoveOut, MoveReport, PauseSteps};

/// What can go wrong with a move; each names the side, request or limit at fault.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    /// A Firecracker API request failed.
    #[error("{side} Firecracker: {request}: {reason}")]
    Firecracker {
        /// `source` or `destination`.
        side: &'static str,
        /// The request.
        request: String,
        /// Its answer or error.
        reason: String,
    },
    /// The control connection between the hosts failed.
    #[error("move control connection with {peer}: {reason}")]
    Wire {
        /// The other host.
        peer: String,
        /// What went wrong.
        reason: String,
    },
    /// The other side refused the move.
    #[error("the {side} refused the move: {reason}")]
    Refused {
        /// Who refused.
        side: &'static str,
        /// Why.
        reason: String,
    },
    /// The move failed after the pause, before the destination ran; the VM was resumed
    /// on the source (or, when `resumed` is false, could not be: see `resume`).
    #[error("move failed after the pause ({reason}); {}", if *resumed { "the VM runs on the source again".to_string() } else { format!("resuming it on the source failed too: {resume}") })]
    Failed {
        /// Why the move failed.
        reason: String,
        /// Whether the VM runs on the source again.
        resumed: bool,
        /// Why it could not be resumed, if it could not.
        resume: String,
    },
    /// A move key that cannot be used (its file: unreadable, open to others, the wrong
    /// size).
    #[error("move key {path}: {reason}")]
    Key {
        /// Its file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The store.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The page server.
    #[error(transparent)]
    Serve(#[from] crate::serve::ServeError),
    /// A local file or socket.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// To what.
        path: std::path::PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Runs its closure if dropped while the thread panics (unwinding through what it guards).
pub(crate) struct OnPanic<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnPanic<F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)();
        }
    }
}

/// Runs its function when dropped, a panic's unwinding included.
pub(crate) struct OnDrop<F: FnMut()>(pub(crate) F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

/// Makes `dir` (mode 0700, with any parent missing) or takes it as it is, and refuses one
/// another user owns or others may write to: a VM's memory and state are written there,
/// and a symlink planted in it would take those writes elsewhere.
pub fn private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let meta = std::fs::symlink_metadata(dir)?;
    // SAFETY: geteuid takes nothing and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "not a folder of this user's that only it may write to (owner {}, mode {:o}): a VM's memory and state go there",
                meta.uid(),
                meta.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    /// A move's folder is made 0700, and one others may write to, or a symlink, is refused
    /// (a link planted there would take a VM's memory elsewhere).
    #[test]
    fn a_folder_others_may_write_to_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let scratch = guestmem_testkit::Scratch::new("private-dir");
        let fresh = scratch.join("a").join("b");
        super::private_dir(&fresh).unwrap();
        let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{mode:o}");
        super::private_dir(&fresh).unwrap();
        let open = scratch.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = super::private_dir(&open).unwrap_err();
        assert!(e.to_string().contains("mode 777"), "{e}");
        let link = scratch.join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        assert!(super::private_dir(&link).is_err());
    }
    use super::OnPanic;
    use std::cell::Cell;

    #[test]
    fn the_resume_guard_acts_on_a_panic_only() {
        let acted = Cell::new(0);
        drop(OnPanic(|| acted.set(acted.get() + 1)));
        assert_eq!(acted.get(), 0);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = OnPanic(|| acted.set(acted.get() + 1));
            panic!("in the pause");
        }));
        assert!(r.is_err());
        assert_eq!(acted.get(), 1);
    }
}
