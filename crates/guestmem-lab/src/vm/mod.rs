//! The guest side of `guestmem-lab vm`: a hand-assembled guest, vCPU threads running it against
//! a guestmem map registered with KVM, and a dirty-logging performance run modelled on KVM's
//! `dirty_log_perf_test`. A test rig and a lab instrument, not library API: the library's
//! `guestmem::kvm` keeps what a VMM needs (the VM, memslots, dirty-log harvesting).
//!
//! - [`program`]: the guest routines (32-bit and 64-bit) and the CPU state.
//! - [`guest`]: vCPU threads running them against the map.
//! - [`perf`]: the `guestmem-lab vm` engine.
//!
//! What this machine's nested KVM accepts is recorded in [`program`]: flat 32-bit protected
//! mode without paging, and long mode once the guest has page tables.

pub mod fc_peer;
pub mod guest;
pub mod perf;
pub mod program;
pub mod restore_run;

use guestmem::kvm::KvmError;
use guestmem::{MapError, TranslateError};

/// Why the guest workload failed.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// The library's KVM layer refused (VM, memslots, harvesting).
    #[error(transparent)]
    Kvm(#[from] KvmError),
    /// The map refused a change.
    #[error(transparent)]
    Map(#[from] MapError),
    /// Bringing guest memory up (the prefault) failed.
    #[error(transparent)]
    Bringup(#[from] guestmem::BringupError),
    /// A guest-memory access failed.
    #[error(transparent)]
    Translate(#[from] TranslateError),
    /// A vCPU ioctl failed.
    #[error("{op} failed: {source}")]
    Ioctl {
        /// The operation.
        op: &'static str,
        /// The errno.
        source: std::io::Error,
    },
    /// A vCPU stopped for a reason the workload does not expect.
    #[error("vCPU {vcpu}: unexpected exit {exit}")]
    UnexpectedExit {
        /// The vCPU index.
        vcpu: usize,
        /// The exit, as text.
        exit: String,
    },
    /// The workload's configuration cannot be run.
    #[error("workload: {0}")]
    Config(String),
    /// The vCPU was stopped from outside ([`guest::Stopper`]).
    #[error("vCPU {vcpu}: stopped")]
    Stopped {
        /// The vCPU index.
        vcpu: usize,
    },
    /// Saving or restoring guest memory failed.
    #[error(transparent)]
    Snapshot(#[from] guestmem::snapshot::SnapshotError),
    /// A lazy restore failed while the guest ran; its vCPUs were stopped.
    #[error("guest stopped: {0}")]
    Restore(String),
    /// A vCPU thread died or could not be started.
    #[error("vCPU {vcpu}: thread failed: {what}")]
    Thread {
        /// The vCPU index.
        vcpu: usize,
        /// What happened.
        what: String,
    },
}

impl VmError {
    fn ioctl(op: &'static str, e: vmm_sys_util::errno::Error) -> VmError {
        VmError::Ioctl {
            op,
            source: std::io::Error::from_raw_os_error(e.errno()),
        }
    }
}
