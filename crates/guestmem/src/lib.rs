//! guestmem: a guest-memory engine for virtual machine monitors.
//!
//! - [`layout`]: where each region goes in the host address space, huge-page congruent, with
//!   guard pages outside its aligned span.
//! - [`region`]: one mapped region, all-or-nothing.
//! - [`map`]: the guest physical map as immutable, generation-numbered snapshots (RCU).
//! - [`translate`]: per-thread guest-to-host translation with a last-used-region cache.
//! - [`inspect`]: what the kernel really did (smaps, numa_maps, status).
//! - `vm-memory` compatibility: [`map::Snapshot`] and [`translate::Translator`] implement
//!   `GuestMemoryBackend`, [`map::GuestMap`] implements `GuestAddressSpace`.
//!
//! Linux only: every part is built on Linux memory syscalls.
#![deny(missing_docs)]

#[cfg(not(target_os = "linux"))]
compile_error!("guestmem supports Linux only");

pub mod dirty;
pub mod inspect;
#[cfg(feature = "kvm")]
pub mod kvm;
pub mod layout;
pub mod map;
pub mod region;
pub mod sys;
pub mod translate;
mod vmm;

pub use layout::{Access, Backing, Guard, HugePageSize, RegionSpec, Reserve, Thp, MAX_REGIONS};
pub use map::{GuestMap, MapError, Snapshot};
pub use region::{Region, RegionError};
pub use translate::{TranslateError, Translator};
pub use vm_memory;
pub use vm_memory::GuestAddress;
