//! A page server for Firecracker's snapshot restores: the lazy restore's engine serving
//! other processes' memory, for one VM or for every VM of a host.
//!
//! # The protocol
//!
//! Firecracker, told to restore with a `Uffd` memory backend, maps fresh private anonymous
//! memory, registers it with a userfaultfd it opens (`O_NONBLOCK`), connects to a Unix
//! socket and sends one message: the descriptor (`SCM_RIGHTS`) and a JSON array with one
//! object per region, `{"base_host_virt_addr", "size", "offset", "page_size",
//! "page_size_kib"}` (`offset` in the memory file; `page_size_kib` holds bytes despite its
//! name, and the oldest releases send neither, meaning 4 KiB pages). It keeps its end of
//! the socket open for as long as it runs, so the socket closing is how a server learns
//! the VM has gone. With a balloon device it asks for remove events: each `MADV_DONTNEED`
//! of guest memory arrives as `UFFD_EVENT_REMOVE`, and the pages removed must read as zero
//! when next touched.
//!
//! # One server
//!
//! A [`Server`] has one or more sockets ([`Socket`]: a [`Listener`], the snapshot's
//! [`MemoryFile`], and a working set to prefetch first), and serves every VM that connects
//! to any of them ([`Vms::Every`]) until drained, or the first VM only ([`Vms::One`]: it
//! stops listening once it has admitted that VM, and returns when the VM goes). Either way
//! the same parts do the work:
//!
//! - the intake (`intake.rs`): connections accepted, each handshake read and checked on a
//!   thread of its own ([`Handshake`]: one descriptor, a userfaultfd, JSON regions that
//!   hold together), so a squatter holds up nobody;
//! - admission (`server.rs`): within [`ServerConfig::max_vms`] and
//!   [`ServerConfig::max_bytes`], the regions checked against the memory file;
//! - a session per VM (`session.rs`): the lazy engine over the VM's memory, reached through
//!   a narrow interface (`crate::restore::RemoteRestore`), a block (1 MiB by default) per
//!   fault, each block read once;
//! - one pool of threads (`pool.rs`): [`ServerConfig::handler_threads`] serve every VM's
//!   faults, [`ServerConfig::prefetch_threads`] prefetch every VM below them in priority (a
//!   working set first, then the rest);
//! - one supervisor ([`Server::run`]) blocked in `poll` on the sockets, the intake, each
//!   VM's socket and failure descriptor, the drain and hand-off eventfds.
//!
//! # A VM is never left hung
//!
//! Once a VM has sent its userfaultfd it depends on this server: Firecracker keeps its own
//! reference, so a VM whose server stops serving waits on its faults for ever. Every
//! refusal from then on (a handshake that does not hold together, regions the memory file
//! cannot hold, a limit, a server that already has its one VM or is draining) and every
//! serving failure (the file unreadable or changed under it) ends that VM as
//! [`OnFailure`] says, through a pidfd taken when it connected ([`PeerProcess`]), and logs
//! why; the other VMs are untouched. Idle means blocked: no thread of a server polls.
//!
//! # Draining, restarts and upgrades
//!
//! Draining ([`Drainer::drain`], SIGTERM in the CLI): the sockets close at once (their
//! paths removed), handshakes in flight finish and are admitted, and then every VM
//! graduates: every block not yet in is brought in (faults still first), and only then are
//! its ranges unregistered, so the VM depends on neither this server nor the memory file.
//! With a state directory a server outlives its own crash (`state.rs`, `restart.rs`), and
//! [`take_over`] hands a running server's sockets and VMs to a new one without downtime
//! (`handoff.rs`, `takeover.rs`).
//!
//! # Memory
//!
//! A server keeps totals per socket ([`ServerStatus`]) and the VMs it serves now, never a
//! record of every VM it served: its memory is bounded by what it serves now.

mod config;
mod error;
mod expose;
mod files;
mod handoff;
mod handshake;
mod intake;
mod learn;
mod listener;
#[cfg(feature = "metrics")]
mod metrics;
mod peer;
mod pool;
mod regions;
mod report;
mod restart;
mod server;
mod session;
mod state;
mod status;
mod takeover;
mod watch;

pub(crate) use config::SessionEvent;
pub use config::{
    OnFailure, ServeLog, ServerConfig, Setting, Vms, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_VMS,
    MAX_SERVE_THREADS,
};
pub use error::{MemoryFileProblem, RecordProblem, ServeError, StateDirProblem, WorkingSetProblem};
pub use expose::Exposed;
pub use files::{MemoryFile, WorkingSetFile, MAX_WORKING_SET_BYTES};
pub use handshake::{Handshake, HandshakeError, MAX_HANDSHAKE_BYTES};
pub use listener::{Listener, SocketRefusal};
pub use peer::PeerProcess;
pub use pool::PrefetchHold;
pub use regions::{parse_regions, UffdRegion, HUGE_PAGE_BYTES, PAGE_SIZES, SMALL_PAGE_BYTES};
pub use report::{SessionEnd, SessionReport};
pub use server::{Drainer, Server, ServerReport, Socket};
pub use status::{EndCounts, ServerStatus, SessionStatus, SocketStatus, StatusHandle};
pub use takeover::{take_over, TakeOver};
