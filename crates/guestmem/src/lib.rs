//! guestmem: a guest-memory engine for virtual machine monitors.
//!
//! - [`host`]: every fact read from the host once, and what a set of regions needs from it.
//! - [`mmap`]: owned reservations and mappings; the only place a range is unmapped, remapped
//!   or advised, each call checked against its owner first.
//! - [`layout`]: where each region goes in the host address space, huge-page congruent, with
//!   guard pages outside its aligned span; [`region`] maps one, all-or-nothing.
//! - [`map`]: the guest physical map as immutable, generation-numbered views (RCU).
//! - [`translate`]: per-thread guest-to-host translation with a last-used-region cache.
//! - [`jobs`]: the one job splitter for parallel work, after padata, on `workers` started
//!   behind one gate.
//! - [`mod@populate`]: populate and pin any regions of a map in one job, transactionally;
//!   [`limits`] checks the request first and [`mod@bringup`] runs both and reports.
//! - [`dirty`]: word-level atomic dirty bitmaps; [`kvm`]: memslots and dirty-log harvesting.
//! - [`inspect`]: what the kernel really did (smaps, numa_maps, status).
//! - [`snapshot`]: saving a map's memory to a directory published whole, and opening one
//!   (every file checked before it is read); [`restore`]: eager, mapped or lazy
//!   (userfaultfd) restores; [`serve`]: a page server for Firecracker's restores, on the
//!   lazy restore's engine.
//! - [`plan`]: sizes, layouts and layout files as people write them.
//! - vm-memory: [`map::MapView`] and [`translate::Translator`] implement `GuestMemory`
//!   (the device view, with `Permissions`), [`map::GuestMap`] implements
//!   `GuestAddressSpace` (in the private module `vm_memory_impl`).
//!
//! Linux only: every part is built on Linux memory syscalls.
//!
//! # What safe code cannot do
//!
//! Raw syscalls on address ranges are not public API: no safe function takes a raw address
//! or a `Copy` range and unmaps, remaps or advises it. Each `compile_fail` example below has a
//! twin that compiles and differs only in the line the comment names, so each fails for the
//! reason given (the error codes are checked where rustdoc checks them, on nightly).
//!
//! ```
//! let map = guestmem::GuestMap::from_specs(&[guestmem::RegionSpec::new(
//!     guestmem::GuestAddress(0), 1 << 20)]).unwrap();
//! let snap = map.view();
//! let region = &snap.regions()[0];
//! let _host: *mut u8 = region.host_addr(); // a raw pointer: using it needs `unsafe`
//! ```
//!
//! ```compile_fail,E0603
//! let map = guestmem::GuestMap::from_specs(&[guestmem::RegionSpec::new(
//!     guestmem::GuestAddress(0), 1 << 20)]).unwrap();
//! let snap = map.view();
//! let region = &snap.regions()[0];
//! guestmem::sys::base_page_size(); // `sys` is private: no safe munmap or madvise to reach
//! ```
//!
//! ```compile_fail,E0599
//! let map = guestmem::GuestMap::from_specs(&[guestmem::RegionSpec::new(
//!     guestmem::GuestAddress(0), 1 << 20)]).unwrap();
//! let snap = map.view();
//! let region = &snap.regions()[0];
//! let _range = region.host_range(); // no `Copy` range of a region's memory is handed out
//! ```
//!
//! An owned mapping is neither `Copy` nor `Clone`, and what it hands out borrows it:
//!
//! ```
//! use guestmem::vm_memory::Bytes;
//! let m = guestmem::mmap::Mapping::anonymous(4096).unwrap();
//! let slice = m.slice(0, 4096).unwrap();
//! slice.write_obj(1u8, 0).unwrap();
//! drop(m);
//! ```
//!
//! ```compile_fail,E0599
//! let m = guestmem::mmap::Mapping::anonymous(4096).unwrap();
//! let twin = m.clone(); // one owner unmaps it, once
//! ```
//!
//! ```compile_fail,E0505
//! use guestmem::vm_memory::Bytes;
//! let m = guestmem::mmap::Mapping::anonymous(4096).unwrap();
//! let slice = m.slice(0, 4096).unwrap();
//! drop(m); // unmapped on drop: the slice may not outlive it
//! slice.write_obj(1u8, 0).unwrap();
//! ```
//!
//! Memory that could raise `SIGBUS` needs an `unsafe` promise: a file placed in a reservation
//! (it must not shrink), a hugetlb region without a reservation (it must be populated before
//! it is touched). One exception, as in every VMM: a region backed by a regular file the
//! caller names (`Backing::File`, `Backing::FilePrivate`) is checked to hold the region when
//! mapped, but if anyone truncates that file later, a touch of the lost part raises
//! `SIGBUS`, as does a write to a hole of a sparse file whose file system is full (see
//! `region`; memfds guestmem makes are sealed against shrinking).
//!
//! ```
//! # use guestmem::{Backing, GuestAddress, HugePageSize, RegionSpec, Reserve};
//! let r = guestmem::mmap::Reservation::new(2 * 4096).unwrap();
//! let m = r.place(0, 4096).unwrap(); // anonymous memory: nothing can shrink it
//! let spec = RegionSpec::new(GuestAddress(0), 2 << 20)
//!     .with_backing(Backing::Hugetlb(HugePageSize::Size2M));
//! // SAFETY: (for the example) nothing maps or touches this spec.
//! let spec = unsafe { spec.with_reserve(Reserve::NoReserve) };
//! ```
//!
//! ```compile_fail,E0133
//! # use guestmem::{Backing, GuestAddress, HugePageSize, RegionSpec, Reserve};
//! let spec = RegionSpec::new(GuestAddress(0), 2 << 20)
//!     .with_backing(Backing::Hugetlb(HugePageSize::Size2M));
//! let spec = spec.with_reserve(Reserve::NoReserve); // a promise only `unsafe` can make
//! ```
//!
//! ```compile_fail,E0133
//! use std::os::fd::AsFd;
//! let file = std::fs::File::open("/dev/zero").unwrap();
//! let r = guestmem::mmap::Reservation::new(2 * 4096).unwrap();
//! let source = guestmem::mmap::MapSource::SharedFile { fd: file.as_fd(), offset: 0 };
//! let m = r.place_file(0, 4096, source, guestmem::Reserve::Reserve); // the file could shrink
//! ```
//!
//! Guest memory handed to device code borrows the view or translator that keeps its
//! region mapped:
//!
//! ```
//! use guestmem::vm_memory::{Bytes, GuestMemory, Permissions};
//! let map = guestmem::GuestMap::from_specs(&[guestmem::RegionSpec::new(
//!     guestmem::GuestAddress(0), 1 << 20)]).unwrap();
//! let snap = map.view();
//! let mut slices = snap.get_slices(guestmem::GuestAddress(0), 16, Permissions::Write).unwrap();
//! let slice = slices.next().unwrap().unwrap();
//! slice.write_obj(1u8, 0).unwrap();
//! drop(slices);
//! drop(snap);
//! let t = map.translator();
//! let slice = t.translate(guestmem::GuestAddress(0), 16).unwrap();
//! slice.write_obj(1u8, 0).unwrap();
//! drop(t);
//! ```
//!
//! ```compile_fail,E0505
//! use guestmem::vm_memory::{Bytes, GuestMemory, Permissions};
//! let map = guestmem::GuestMap::from_specs(&[guestmem::RegionSpec::new(
//!     guestmem::GuestAddress(0), 1 << 20)]).unwrap();
//! let snap = map.view();
//! let mut slices = snap.get_slices(guestmem::GuestAddress(0), 16, Permissions::Write).unwrap();
//! let slice = slices.next().unwrap().unwrap();
//! drop(slices);
//! drop(snap); // the view keeps the region mapped: the slice may not outlive it
//! slice.write_obj(1u8, 0).unwrap();
//! ```
//!
//! ```compile_fail,E0505
//! use guestmem::vm_memory::Bytes;
//! let map = guestmem::GuestMap::from_specs(&[guestmem::RegionSpec::new(
//!     guestmem::GuestAddress(0), 1 << 20)]).unwrap();
//! let t = map.translator();
//! let slice = t.translate(guestmem::GuestAddress(0), 16).unwrap();
//! drop(t); // the translator pins the view: the slice may not outlive it
//! slice.write_obj(1u8, 0).unwrap();
//! ```
#![deny(missing_docs)]

#[cfg(not(target_os = "linux"))]
compile_error!("guestmem supports Linux only");

mod batch;
pub mod bringup;
pub mod dirty;
mod files;
pub mod host;
pub mod inspect;
pub mod jobs;
#[cfg(feature = "kvm")]
pub mod kvm;
pub mod layout;
mod lifecycle;
pub mod limits;
pub mod map;
#[cfg(feature = "store")]
pub mod migrate;
pub mod mmap;
#[cfg(test)]
mod outside_input;
pub mod plan;
pub mod populate;
pub mod region;
pub mod restore;
pub mod serve;
pub mod snapshot;
#[cfg(feature = "store")]
pub mod store;
mod sys;
pub mod translate;
mod uffd;
mod vm_memory_impl;
// The one start gate and worker spawn loop: public only with the `lab-internals` feature,
// for the lab's peers.
#[cfg(feature = "lab-internals")]
pub mod workers;
#[cfg(not(feature = "lab-internals"))]
mod workers;

pub use bringup::{
    bringup, bringup_background, bringup_specs, BringupConfig, BringupError, BringupHandle,
    BringupReport, PinPolicy, Verify,
};
pub use host::{Host, HostError};
pub use jobs::{default_threads, JobStats, Numa, Progress};
pub use layout::{
    Access, Backing, DirtyTracking, Guard, HugePageSize, RegionSpec, Reserve, Thp, MAX_REGIONS,
};
pub use map::{GuestMap, MapError, MapView};
pub use populate::{
    populate, Method, PinStrategy, PopulateConfig, PopulateError, PopulateReport, Selection, Undo,
};
pub use region::{Region, RegionError};
pub use translate::{TranslateError, Translator};
pub use vm_memory;
pub use vm_memory::GuestAddress;
pub use vm_memory_impl::ReadOnlyWrite;

/// The base page size of this host, in bytes.
pub fn base_page_size() -> u64 {
    sys::base_page_size()
}
