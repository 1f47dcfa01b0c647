//! guestmem: a guest-memory engine for virtual machine monitors.
//!
//! - [`layout`]: where each region goes in the host address space, huge-page congruent, with
//!   guard pages outside its aligned span.
//! - [`region`]: one mapped region, all-or-nothing.
//! - [`map`]: the guest physical map as immutable, generation-numbered snapshots (RCU).
//! - [`translate`]: per-thread guest-to-host translation with a last-used-region cache.
//! - [`jobs`]: the one job splitter for parallel work, after padata.
//! - [`populate`]: populate and pin every region of a map in one job, transactionally;
//!   [`limits`] checks the request first and [`bringup`] runs both and reports.
//! - [`inspect`]: what the kernel really did (smaps, numa_maps, status).
//! - `vm-memory` compatibility: [`map::Snapshot`] and [`translate::Translator`] implement
//!   `GuestMemoryBackend`, [`map::GuestMap`] implements `GuestAddressSpace`.
//!
//! Linux only: every part is built on Linux memory syscalls.
#![deny(missing_docs)]

#[cfg(not(target_os = "linux"))]
compile_error!("guestmem supports Linux only");

pub mod bringup;
pub mod dirty;
pub mod inspect;
pub mod jobs;
#[cfg(feature = "kvm")]
pub mod kvm;
pub mod layout;
pub mod limits;
pub mod map;
pub mod plan;
pub mod populate;
pub mod region;
pub mod sys;
pub mod translate;
mod vmm;

pub use bringup::{bringup, BringupConfig, BringupError, BringupReport, Verify};
pub use jobs::{Chunk, Job, JobRange, Numa};
pub use layout::{Access, Backing, Guard, HugePageSize, RegionSpec, Reserve, Thp, MAX_REGIONS};
pub use map::{GuestMap, MapError, Snapshot};
pub use populate::{populate, Method, PinStrategy, PopulateConfig, PopulateError, PopulateReport};
pub use region::{Region, RegionError};
pub use translate::{TranslateError, Translator};
pub use vm_memory;
pub use vm_memory::GuestAddress;
