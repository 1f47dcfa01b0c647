//! Memslots follow the map: hot-add and hot-remove while vCPUs run, and bad input.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use guestmem::kvm::{KvmError, KvmVm, MemslotConfig, Memslots, VmConfig};
use guestmem::{Access, GuestAddress, GuestMap, RegionSpec};
use guestmem_lab::vm::guest::{pattern, GuestMode, Partition, Workload, WorkloadConfig};

const HOT_GPA: u64 = 0xc000_0000;

#[test]
fn hot_add_and_remove_while_vcpus_run_keeps_guest_passes_correct() {
    if !common::kvm_usable() {
        return;
    }
    let mut s = common::setup(32 << 20, 8);
    let config = WorkloadConfig {
        vcpus: 2,
        partition: Partition::PerSlot,
        mode: GuestMode::Protected32,
    };
    let work = Workload::start(&s.vm, &s.map, &s.data, config).unwrap();
    let stop = AtomicBool::new(false);

    let passes = std::thread::scope(|scope| {
        let runner = scope.spawn(|| {
            let mut passes = 0u32;
            while !stop.load(Ordering::Acquire) || passes < 3 {
                passes += 1;
                let out = work.write_pass(passes).unwrap();
                assert_eq!(out.values, vec![passes; 2]);
            }
            passes
        });
        for round in 0..5u8 {
            let r = s
                .map
                .add(&RegionSpec::new(GuestAddress(HOT_GPA), 4 << 20))
                .unwrap();
            let added = s.slots.sync(&s.map.view()).unwrap();
            assert_eq!(added.added.len(), 1);
            assert_eq!(added.added[0].guest_addr, HOT_GPA);
            assert!(added.removed.is_empty());
            let t = s.map.translator();
            t.write_in_region(GuestAddress(HOT_GPA + 0x1234), &[round; 16])
                .unwrap();
            let mut b = [0u8; 16];
            t.read_in_region(GuestAddress(HOT_GPA + 0x1234), &mut b)
                .unwrap();
            assert_eq!(b, [round; 16]);
            drop(t);

            s.map.remove(GuestAddress(HOT_GPA)).unwrap();
            // The registry still holds the region: KVM maps it until sync deletes the slot.
            assert!(Arc::strong_count(&r) >= 2);
            let removed = s.slots.sync(&s.map.view()).unwrap();
            assert_eq!(removed.removed.len(), 1);
            assert!(removed.added.is_empty());
            assert_eq!(Arc::strong_count(&r), 1, "only this handle is left");
        }
        stop.store(true, Ordering::Release);
        runner.join().unwrap()
    });

    // The vCPUs' own memory holds the last pass's pattern.
    let t = s.map.translator();
    for v in 0..2 {
        for &(a, _) in work.slice(v) {
            let mut b = [0u8; 4];
            t.read_in_region(GuestAddress(a), &mut b).unwrap();
            assert_eq!(u32::from_le_bytes(b), pattern(a, passes));
        }
    }
    assert_eq!(s.slots.slots().len(), 9);
}

#[test]
fn open_missing_device_names_the_path() {
    let e = KvmVm::open(&VmConfig {
        kvm_path: PathBuf::from("/nonexistent/kvm"),
        ..VmConfig::default()
    })
    .unwrap_err();
    assert!(matches!(e, KvmError::Open { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/kvm"), "{e}");
}

fn vm_and_map(specs: &[RegionSpec]) -> (Arc<KvmVm>, GuestMap) {
    let vm = Arc::new(KvmVm::open(&VmConfig::default()).unwrap());
    (vm, GuestMap::from_specs(specs).unwrap())
}

#[test]
fn sync_more_slots_than_allowed_is_refused_before_registering() {
    if !common::kvm_usable() {
        return;
    }
    let specs: Vec<_> = (0..3u64)
        .map(|i| RegionSpec::new(GuestAddress(i << 24), 1 << 20))
        .collect();
    let (vm, map) = vm_and_map(&specs);
    let mut slots = Memslots::new(
        vm,
        MemslotConfig {
            max_slots: Some(2),
            ..MemslotConfig::default()
        },
    )
    .unwrap();

    let e = slots.sync(&map.view()).unwrap_err();

    assert!(
        matches!(
            e,
            KvmError::TooManySlots {
                needed: 3,
                limit: 2,
                addr: 0x200_0000
            }
        ),
        "{e}"
    );
    assert!(slots.slots().is_empty());
}

#[test]
fn sync_region_kvm_refuses_names_it_and_undoes_the_call() {
    if !common::kvm_usable() {
        return;
    }
    // Beyond any x86 guest physical address width: KVM refuses the slot.
    let bad = 1u64 << 56;
    let (vm, map) = vm_and_map(&[
        RegionSpec::new(GuestAddress(0), 1 << 20),
        RegionSpec::new(GuestAddress(1 << 24), 1 << 20),
        RegionSpec::new(GuestAddress(bad), 1 << 20),
    ]);
    let mut slots = Memslots::new(vm, MemslotConfig::default()).unwrap();

    let e = slots.sync(&map.view()).unwrap_err();

    assert!(
        matches!(e, KvmError::Slot { addr, .. } if addr == bad),
        "{e}"
    );
    assert!(e.to_string().contains("0x100000000000000"), "{e}");
    assert!(slots.slots().is_empty());
    // The slot numbers were given back: a good map registers from slot 0 again.
    map.remove(GuestAddress(bad)).unwrap();
    let r = slots.sync(&map.view()).unwrap();
    let mut ids: Vec<u32> = r.added.iter().map(|i| i.slot).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1]);
}

#[test]
fn sync_read_only_region_gets_readonly_flag_and_no_logging() {
    if !common::kvm_usable() {
        return;
    }
    let (vm, map) = vm_and_map(&[
        RegionSpec::new(GuestAddress(0), 1 << 20).with_access(Access::ReadOnly),
        RegionSpec::new(GuestAddress(1 << 24), 1 << 20),
    ]);
    let logging = MemslotConfig {
        dirty_logging: guestmem::kvm::DirtyLogging::On,
        ..MemslotConfig::default()
    };
    let mut slots = Memslots::new(vm, logging).unwrap();

    slots.sync(&map.view()).unwrap();

    let flags: Vec<u32> = slots.slots().iter().map(|s| s.flags).collect();
    assert_eq!(
        flags,
        [
            kvm_bindings::KVM_MEM_READONLY,
            kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES
        ]
    );
}

#[test]
fn open_a_device_that_is_not_kvm_is_refused() {
    let e = KvmVm::open(&VmConfig {
        kvm_path: PathBuf::from("/dev/null"),
        ..VmConfig::default()
    })
    .unwrap_err();
    assert!(matches!(e, KvmError::Open { .. }), "{e}");
    assert!(e.to_string().contains("not the KVM device"), "{e}");
}

#[test]
fn a_vm_has_one_memslots_registry_at_a_time() {
    if !common::kvm_usable() {
        return;
    }
    let (vm, map) = vm_and_map(&[RegionSpec::new(GuestAddress(0), 4096)]);
    let mut first = Memslots::new(vm.clone(), MemslotConfig::default()).unwrap();
    first.sync(&map.view()).unwrap();
    // A second registry would number slots on its own and trust its buffers for slots the
    // first one reuses: refused.
    let e = Memslots::new(vm.clone(), MemslotConfig::default()).unwrap_err();
    assert!(matches!(e, KvmError::MemslotsTaken), "{e}");
    drop(first);
    let mut again = Memslots::new(vm, MemslotConfig::default()).unwrap();
    assert_eq!(again.sync(&map.view()).unwrap().added.len(), 1);
}
