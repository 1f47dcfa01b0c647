//! Dirty tracking with a guest and device code side by side: the harvested set is exactly the
//! union of what the vCPUs wrote and what a device wrote through the device view; and dirty
//! logging costs KVM its huge pages only while it is on.

mod common;

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use guestmem::dirty::DirtyPages;
use guestmem::kvm::{DirtyLogging, KvmVm, MemslotConfig, Memslots, VmConfig};
use guestmem::vm_memory::{Bytes, GuestAddressSpace};
use guestmem::{DirtyTracking, GuestAddress, GuestMap, RegionSpec};
use guestmem_lab::vm::guest::{control_spec, GuestMode, Range, Workload};

const DATA_GPA: u64 = 1 << 30;
const PAGE: u64 = 4096;

fn vm_with(data: RegionSpec, logging: DirtyLogging) -> (Arc<KvmVm>, GuestMap, Memslots) {
    let map = GuestMap::from_specs(&[control_spec(), data]).unwrap();
    let vm = Arc::new(KvmVm::open(&VmConfig::default()).unwrap());
    let cfg = MemslotConfig {
        dirty_logging: logging,
        ..MemslotConfig::default()
    };
    let mut slots = Memslots::new(vm.clone(), cfg).unwrap();
    slots.sync(&map.view()).unwrap();
    (vm, map, slots)
}

#[test]
fn harvest_is_the_union_of_guest_and_device_writes_no_more_no_fewer() {
    if !common::kvm_usable() {
        return;
    }
    // 8 MiB of data that tracks device writes, with KVM's dirty logging on.
    let data =
        RegionSpec::new(GuestAddress(DATA_GPA), 8 << 20).with_dirty_tracking(DirtyTracking::On);
    let (vm, map, mut slots) = vm_with(data, DirtyLogging::On);
    // Two vCPUs write pages 0..300 and 1000..1300; a device writes every 7th page of
    // 200..1200 through the device view (vm-memory's Bytes on GuestMap::memory()), at the
    // same time. The sets overlap on 200..300 and 1000..1200.
    let slices: Vec<Vec<Range>> = vec![
        vec![(DATA_GPA, DATA_GPA + 300 * PAGE)],
        vec![(DATA_GPA + 1000 * PAGE, DATA_GPA + 1300 * PAGE)],
    ];
    let guest: BTreeSet<u64> = (0..300).chain(1000..1300).collect();
    let device: BTreeSet<u64> = (200..1200).step_by(7).collect();
    let work = Workload::start_with_slices(&vm, &map, slices, GuestMode::Protected32).unwrap();
    std::thread::scope(|s| {
        let map = &map;
        let device = &device;
        s.spawn(move || {
            let mem = map.memory();
            for &p in device {
                mem.write_obj(0xd0_u64 + p, GuestAddress(DATA_GPA + p * PAGE + 64))
                    .unwrap();
            }
        });
        assert_eq!(work.write_pass(5).unwrap().values, vec![5, 5]);
    });

    let union: BTreeSet<u64> = guest.union(&device).copied().collect();
    assert_eq!(harvested(&mut slots), union);
    // The region's own bitmap is the slot's: one set.
    assert!(map.view().regions()[1].dirty_bitmap().unwrap().count() == 0);
}

/// debugfs mounted for the test's length (and unmounted after, if the test mounted it).
struct Debugfs {
    mounted_here: bool,
}

impl Debugfs {
    fn kvm() -> Option<Debugfs> {
        let kvm = std::path::Path::new("/sys/kernel/debug/kvm");
        if kvm.exists() {
            return Some(Debugfs {
                mounted_here: false,
            });
        }
        let ok = std::process::Command::new("mount")
            .args(["-t", "debugfs", "none", "/sys/kernel/debug"])
            .status()
            .is_ok_and(|s| s.success());
        if !ok || !kvm.exists() {
            guestmem_testkit::skip(format_args!(
                "KVM's debugfs statistics are not available (needs root and debugfs)"
            ));
            return None;
        }
        Some(Debugfs { mounted_here: true })
    }
}

impl Drop for Debugfs {
    fn drop(&mut self) {
        if self.mounted_here {
            let _ = std::process::Command::new("umount")
                .arg("/sys/kernel/debug")
                .status();
        }
    }
}

/// KVM's page counts for one VM, `(pages_4k, pages_2m)`, where this kernel keeps them:
/// KVM names a VM's debugfs directory `<tid>-<fd>`, after the thread that created it and the
/// VM's descriptor. `None` where they cannot be read.
fn kvm_pages(vm: &KvmVm) -> Option<(u64, u64)> {
    let fd = vm.as_raw_fd().to_string();
    let dir = std::fs::read_dir("/sys/kernel/debug/kvm")
        .ok()?
        .filter_map(|e| e.ok())
        .find(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.split_once('-').is_some_and(|(tid, f)| {
                f == fd && std::path::Path::new(&format!("/proc/self/task/{tid}")).exists()
            })
        })?
        .path();
    let read = |f: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(f))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some((read("pages_4k")?, read("pages_2m")?))
}

/// The pages of the data slot a harvest reports dirty; the bitmap is emptied.
fn harvested(slots: &mut Memslots) -> BTreeSet<u64> {
    slots.harvest().unwrap();
    let mut words = Vec::new();
    slots
        .bitmap(GuestAddress(DATA_GPA))
        .unwrap()
        .take(&mut words);
    DirtyPages::new(&words).collect()
}

#[test]
fn dirty_logging_switches_at_run_time_and_leaves_the_host_huge_pages() {
    if !common::kvm_usable() {
        return;
    }
    let _debugfs = Debugfs::kvm();
    // 64 MiB of THP memory, congruent and populated with huge pages before the guest runs.
    let data = RegionSpec::new(GuestAddress(DATA_GPA), 64 << 20);
    let (vm, map, mut slots) = vm_with(data, DirtyLogging::Off);
    guestmem::populate(&map.view(), &guestmem::PopulateConfig::default()).unwrap();
    let data_region = map.view().regions()[1].clone();
    let host_huge = || {
        guestmem::inspect::inspect_region(&data_region)
            .unwrap()
            .huge
    };
    assert_eq!(host_huge(), 64 << 20);
    let work = Workload::start(
        &vm,
        &map,
        std::slice::from_ref(&data_region),
        guestmem_lab::vm::guest::WorkloadConfig {
            vcpus: 1,
            partition: guestmem_lab::vm::guest::Partition::Contiguous,
            mode: GuestMode::Long64,
        },
    )
    .unwrap();
    let flags = |slots: &Memslots| slots.slots()[1].flags & kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES;
    let pages = (64u64 << 20) / PAGE;

    // Off (the default): no logging flag, nothing harvested.
    work.write_pass(1).unwrap();
    let off = kvm_pages(&vm);
    assert_eq!(flags(&slots), 0);
    assert!(harvested(&mut slots).is_empty());
    // On, at run time: the flag is set and the next pass's pages are all harvested.
    slots.set_dirty_logging(DirtyLogging::On).unwrap();
    assert_ne!(flags(&slots), 0);
    work.write_pass(2).unwrap();
    let on = kvm_pages(&vm);
    assert_eq!(harvested(&mut slots).len() as u64, pages);
    // Off again: the flag is cleared and passes are not logged.
    slots.set_dirty_logging(DirtyLogging::Off).unwrap();
    assert_eq!(flags(&slots), 0);
    work.write_pass(3).unwrap();
    let again = kvm_pages(&vm);
    assert!(harvested(&mut slots).is_empty());
    // KVM write-protects its own mappings for logging; the host's huge pages stay whole.
    assert_eq!(host_huge(), 64 << 20);

    // What KVM itself mapped, where this kernel shows it.
    match (off, on, again) {
        (Some((_, off_2m)), Some((on_4k, on_2m)), Some((_, again_2m))) if off_2m > 0 => {
            println!("KVM pages_2m with logging off {off_2m}, on {on_2m} (pages_4k {on_4k}), off again {again_2m}");
            assert!(
                on_2m < off_2m && on_4k >= pages / 2,
                "logging on kept huge pages"
            );
            assert!(
                again_2m > on_2m,
                "huge pages not restored after logging off"
            );
        }
        other => println!(
            "not observable here: KVM's pages_4k/pages_2m read {other:?} (this nested, \
             shadow-paging KVM keeps them at 0: they are TDP-MMU counters), and its fault \
             counters (pf_fixed, pf_taken) are denied to reading (EPERM)"
        ),
    }
}
