//! Shared set-up for the KVM tests: a map of a control region and data slots, registered.
#![allow(dead_code)]

use std::sync::Arc;

use guestmem::kvm::{DirtyLogging, KvmVm, MemslotConfig, Memslots, VmConfig, KVM_PATH};
use guestmem::{GuestAddress, GuestMap, Region};
use guestmem_lab::vm::guest::{control_spec, data_specs};

/// Where the tests' data slots start.
pub const DATA_GPA: u64 = 1 << 30;

/// Returns false (after printing why) when KVM cannot be used here.
pub fn kvm_usable() -> bool {
    match guestmem::kvm::unavailable_reason(std::path::Path::new(KVM_PATH)) {
        None => true,
        Some(why) => {
            guestmem_testkit::skip(format_args!("{why}"));
            false
        }
    }
}

/// A VM whose map holds the control region and `slots` data slots of `bytes` in all.
pub struct Setup {
    pub vm: Arc<KvmVm>,
    pub map: GuestMap,
    pub slots: Memslots,
    pub data: Vec<Arc<Region>>,
}

pub fn setup(bytes: u64, slots: usize) -> Setup {
    let mut specs = data_specs(GuestAddress(DATA_GPA), bytes, slots).unwrap();
    specs.push(control_spec());
    let map = GuestMap::from_specs(&specs).unwrap();
    let vm = Arc::new(KvmVm::open(&VmConfig::default()).unwrap());
    // These tests harvest: dirty logging on from the start (it is off by default).
    let logging = MemslotConfig {
        dirty_logging: DirtyLogging::On,
        ..MemslotConfig::default()
    };
    let mut memslots = Memslots::new(vm.clone(), logging).unwrap();
    let report = memslots.sync(&map.view()).unwrap();
    assert_eq!(report.added.len(), slots + 1);
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    let data = map
        .view()
        .regions()
        .iter()
        .filter(|r| r.guest_addr().0 >= DATA_GPA)
        .cloned()
        .collect();
    Setup {
        vm,
        map,
        slots: memslots,
        data,
    }
}
