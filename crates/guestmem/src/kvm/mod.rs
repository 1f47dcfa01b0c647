//! The guest map registered with KVM: what a VMM needs, and nothing a test rig does.
//!
//! - [`KvmVm`]: `/dev/kvm` opened, one VM created, the capabilities that matter read once.
//! - [`memslots::Memslots`]: every region of a [`crate::MapView`] as one memslot, kept in
//!   sync with hot-add and hot-remove; it holds each registered region's `Arc`, so a region
//!   is never unmapped while KVM still maps it.
//! - Dirty-log harvesting ([`Memslots::harvest`]): `KVM_GET_DIRTY_LOG` and
//!   `KVM_CLEAR_DIRTY_LOG` into buffers each memslot owns, sized from the slot itself, merged
//!   into the word-level bitmaps of [`crate::dirty`]. The buffers are private, so no safe
//!   call can hand KVM a buffer smaller than the slot it fills.
//!
//! A guest to run on it (vCPU setup, a hand-assembled program, the `dirty_log_perf_test`
//! engine of `guestmem-lab vm`) lives in the lab crate, `guestmem-lab`, not here.
//!
//! The one way to read a dirty log is through the memslots, which size each buffer from
//! its slot:
//!
//! ```no_run
//! # fn harvest(slots: &mut guestmem::kvm::Memslots) -> Result<(), guestmem::kvm::KvmError> {
//! let stats = slots.harvest()?; // every logging slot, into buffers sized from the slot
//! # Ok(()) }
//! ```
//!
//! ```compile_fail,E0603
//! # fn harvest(slots: &mut guestmem::kvm::Memslots) -> Result<(), guestmem::kvm::KvmError> {
//! let log = guestmem::kvm::dirty::SlotLog::new(0, 1); // private: no buffer of your own size
//! # Ok(()) }
//! ```
//!
//! Nor can it reach kvm-ioctls' `VmFd::get_dirty_log`, which trusts its size argument,
//! without an `unsafe` promise not to:
//!
//! ```no_run
//! # fn f(vm: &guestmem::kvm::KvmVm) -> Result<(), guestmem::kvm::KvmError> {
//! let vcpu = vm.create_vcpu(0)?;
//! # Ok(()) }
//! ```
//!
//! ```compile_fail,E0133
//! # fn f(vm: &guestmem::kvm::KvmVm) {
//! let log = vm.vm_fd().get_dirty_log(0, 4096); // the VmFd is behind `unsafe`
//! # }
//! ```

mod dirty;
pub mod memslots;

use std::path::{Path, PathBuf};

use kvm_bindings::{
    kvm_enable_cap, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE,
};
use std::os::fd::FromRawFd;

use kvm_ioctls::{Cap, Kvm, VmFd};

pub use memslots::{DirtyLogging, MemslotConfig, Memslots, SlotInfo, SyncReport};

/// The default KVM device.
pub const KVM_PATH: &str = "/dev/kvm";

/// Why a KVM operation failed. Every variant about a slot names its region.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    /// The KVM device could not be opened (missing, or no permission).
    #[error("cannot open {path}: {source} (is KVM loaded, and may this user open it?)")]
    Open {
        /// The device path.
        path: PathBuf,
        /// The errno.
        source: std::io::Error,
    },
    /// A VM-wide or vCPU ioctl failed.
    #[error("{op} failed: {source}")]
    Ioctl {
        /// The operation.
        op: &'static str,
        /// The errno.
        source: std::io::Error,
    },
    /// Registering the snapshot would need more memslots than KVM offers.
    #[error("{needed} memslots needed, KVM offers {limit} (KVM_CAP_NR_MEMSLOTS); first region left out at {addr:#x}")]
    TooManySlots {
        /// Slots the snapshot needs.
        needed: usize,
        /// KVM's limit.
        limit: usize,
        /// Guest address of the first region that does not fit.
        addr: u64,
    },
    /// A region is read-only but KVM lacks `KVM_CAP_READONLY_MEM`.
    #[error(
        "region at {addr:#x}: read-only memslots need KVM_CAP_READONLY_MEM, which this KVM lacks"
    )]
    ReadOnlyUnsupported {
        /// Guest address of the region.
        addr: u64,
    },
    /// KVM refused a memslot.
    #[error(
        "region at {addr:#x} size {size:#x} (slot {slot}, host {host:#x}): {op} refused: {source}"
    )]
    Slot {
        /// The slot number.
        slot: u32,
        /// Guest address of the region.
        addr: u64,
        /// Its size.
        size: u64,
        /// Its host address.
        host: u64,
        /// The ioctl.
        op: &'static str,
        /// The errno.
        source: std::io::Error,
    },
    /// No registered slot holds this guest range.
    #[error("guest range {addr:#x} + {len:#x} is not inside one registered memslot")]
    NoSlot {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// The VM already has its `Memslots` registry.
    #[error(
        "this VM already has a Memslots registry; a VM has at most one, which numbers every slot"
    )]
    MemslotsTaken,
    /// A dirty bitmap refused an operation.
    #[error(transparent)]
    Dirty(#[from] crate::dirty::DirtyError),
}

impl KvmError {
    pub(crate) fn ioctl(op: &'static str, e: vmm_sys_util::errno::Error) -> KvmError {
        KvmError::Ioctl {
            op,
            source: std::io::Error::from_raw_os_error(e.errno()),
        }
    }
}

/// The capabilities guestmem uses, read once when the VM is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct KvmCaps {
    /// `KVM_CAP_NR_MEMSLOTS`: user memslots per address space.
    pub nr_memslots: usize,
    /// `KVM_CAP_USER_MEMORY2`: `KVM_SET_USER_MEMORY_REGION2` is used.
    pub user_memory2: bool,
    /// `KVM_CAP_READONLY_MEM`.
    pub readonly_mem: bool,
    /// `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` reported and enabled: harvesting is
    /// `KVM_GET_DIRTY_LOG` followed by `KVM_CLEAR_DIRTY_LOG`.
    pub manual_protect: bool,
    /// `KVM_CAP_DIRTY_LOG_RING` size in bytes (0: none). Reported only; not used.
    pub dirty_ring_bytes: i32,
    /// `KVM_CAP_NR_VCPUS`: the recommended vCPU count.
    pub nr_vcpus: usize,
    /// `KVM_CAP_MAX_VCPUS`.
    pub max_vcpus: usize,
}

/// Whether to enable `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` when KVM offers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ManualProtect {
    /// Enable it where reported (the default): clearing becomes a separate, timed step.
    #[default]
    Auto,
    /// Never: `KVM_GET_DIRTY_LOG` clears and re-protects by itself.
    Off,
}

/// How to open KVM and create the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    /// The KVM device ([`KVM_PATH`] by default).
    pub kvm_path: PathBuf,
    /// Manual dirty-log protection.
    pub manual_protect: ManualProtect,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            kvm_path: PathBuf::from(KVM_PATH),
            manual_protect: ManualProtect::Auto,
        }
    }
}

/// An open KVM with one VM.
#[derive(Debug)]
pub struct KvmVm {
    kvm: Kvm,
    vm: VmFd,
    caps: KvmCaps,
    /// Whether a [`Memslots`] registry exists for this VM: there is at most one, since two
    /// would number slots apart and each trust its own buffers for the other's slots.
    memslots_taken: std::sync::atomic::AtomicBool,
}

impl KvmVm {
    /// Opens KVM at `config.kvm_path`, creates a VM and reads its capabilities.
    pub fn open(config: &VmConfig) -> Result<KvmVm, KvmError> {
        let kvm = open_kvm(&config.kvm_path)?;
        let vm = kvm
            .create_vm()
            .map_err(|e| KvmError::ioctl("KVM_CREATE_VM", e))?;
        let mut caps = KvmCaps {
            nr_memslots: vm.check_extension_int(Cap::NrMemslots).max(0) as usize,
            user_memory2: vm.check_extension(Cap::UserMemory2),
            readonly_mem: vm.check_extension(Cap::ReadonlyMem),
            manual_protect: false,
            dirty_ring_bytes: vm.check_extension_int(Cap::DirtyLogRing),
            nr_vcpus: kvm.get_nr_vcpus(),
            max_vcpus: kvm.get_max_vcpus(),
        };
        let offered = vm.check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into());
        if config.manual_protect == ManualProtect::Auto
            && offered & KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE as i32 != 0
        {
            // Without KVM_DIRTY_LOG_INITIALLY_SET: a slot's bitmap starts clean and its pages
            // write-protected, so the first harvest reports exactly what was written.
            let cap = kvm_enable_cap {
                cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
                args: [u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE), 0, 0, 0],
                ..Default::default()
            };
            vm.enable_cap(&cap)
                .map_err(|e| KvmError::ioctl("KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2)", e))?;
            caps.manual_protect = true;
        }
        Ok(KvmVm {
            kvm,
            vm,
            caps,
            memslots_taken: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The capabilities.
    pub fn caps(&self) -> &KvmCaps {
        &self.caps
    }

    /// Creates vCPU `id` (`KVM_CREATE_VCPU`).
    pub fn create_vcpu(&self, id: u64) -> Result<kvm_ioctls::VcpuFd, KvmError> {
        self.vm
            .create_vcpu(id)
            .map_err(|e| KvmError::ioctl("KVM_CREATE_VCPU", e))
    }

    /// The VM descriptor, for the VM ioctls a VMM makes beyond memory (interrupt
    /// controllers, irqfds, ioeventfds, ...).
    ///
    /// # Safety
    /// kvm-ioctls' `VmFd` has safe methods that are unsound against the memslots guestmem
    /// registers: `get_dirty_log(slot, memory_size)` sizes its buffer from `memory_size`, and
    /// KVM fills a whole slot's bitmap whatever that says. The caller must not call
    /// `get_dirty_log` (harvest through [`Memslots::harvest`], whose buffers are sized from
    /// the slot), nor change or delete memslots [`Memslots`] registered, nor turn on
    /// capabilities that change how dirty logs are read (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`
    /// flags, the dirty ring).
    pub unsafe fn vm_fd(&self) -> &VmFd {
        &self.vm
    }

    /// The system descriptor.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }
}

/// The VM's descriptor number, for naming it (KVM's debugfs directory is `<pid>-<fd>`); a
/// raw number, usable for an ioctl only through `unsafe` code.
impl std::os::fd::AsRawFd for KvmVm {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.vm.as_raw_fd()
    }
}

/// The KVM device's numbers: misc character device 10, minor 232 (`KVM_MINOR`).
const KVM_DEVICE: (u32, u32) = (10, 232);

fn open_kvm(path: &Path) -> Result<Kvm, KvmError> {
    use std::os::fd::IntoRawFd;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
    let open_err = |source| KvmError::Open {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(open_err)?;
    // Every ioctl guestmem makes trusts the descriptor to be KVM's: a device that answered
    // KVM's request numbers its own way could write where KVM would not. So the opened file
    // (not the path, which could change between a check and the open) must be the KVM device.
    let meta = file.metadata().map_err(open_err)?;
    let rdev = meta.rdev();
    if !meta.file_type().is_char_device() || (libc::major(rdev), libc::minor(rdev)) != KVM_DEVICE {
        return Err(open_err(std::io::Error::other(format!(
            "not the KVM device (character device {}:{})",
            KVM_DEVICE.0, KVM_DEVICE.1
        ))));
    }
    // SAFETY: the descriptor was just opened read-write and checked (fstat) to be the KVM
    // device; `into_raw_fd` gives up the File's ownership, so the Kvm is its only owner.
    Ok(unsafe { Kvm::from_raw_fd(file.into_raw_fd()) })
}

/// Why KVM cannot be used here, or `None` if it can: for tests and callers that skip.
pub fn unavailable_reason(path: &Path) -> Option<String> {
    match open_kvm(path) {
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}
