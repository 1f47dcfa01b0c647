//! The guest and the host see each other's writes through the same memslots.

mod common;

use guestmem::GuestAddress;
use guestmem_lab::vm::guest::{pattern, GuestMode, Partition, Workload, WorkloadConfig};
use guestmem_lab::vm::program::{PAGE_TABLES_BYTES, PAGE_TABLES_GPA};

const VCPUS: usize = 4;
const SLOTS: usize = 64;
const BYTES: u64 = 128 << 20;

#[test]
fn guest_write_pass_every_slot_host_reads_pattern_back() {
    if !common::kvm_usable() {
        return;
    }
    let s = common::setup(BYTES, SLOTS);
    let config = WorkloadConfig {
        vcpus: VCPUS,
        partition: Partition::PerSlot,
        mode: GuestMode::Protected32,
    };
    let work = Workload::start(&s.vm, &s.map, &s.data, config).unwrap();

    let out = work.write_pass(7).unwrap();

    assert_eq!(out.values, vec![7; VCPUS]);
    let t = s.map.translator();
    let mut pages = 0;
    for v in 0..VCPUS {
        // Every vCPU has a slice in every slot.
        assert_eq!(work.slice(v).len(), SLOTS);
        for &(start, end) in work.slice(v) {
            for gpa in (start..end).step_by(4096) {
                let mut b = [0u8; 8];
                t.read_in_region(GuestAddress(gpa), &mut b).unwrap();
                assert_eq!(
                    u32::from_le_bytes(b[..4].try_into().unwrap()),
                    pattern(gpa, 7)
                );
                // Only the first dword of each page is written.
                assert_eq!(&b[4..], &[0; 4], "gpa {gpa:#x}");
                pages += 1;
            }
        }
    }
    assert_eq!(pages, BYTES / 4096);
}

#[test]
fn host_writes_guest_verifies_and_reports_a_corrupted_page() {
    if !common::kvm_usable() {
        return;
    }
    let s = common::setup(BYTES, SLOTS);
    let config = WorkloadConfig {
        vcpus: VCPUS,
        partition: Partition::PerSlot,
        mode: GuestMode::Protected32,
    };
    let work = Workload::start(&s.vm, &s.map, &s.data, config).unwrap();
    let t = s.map.translator();
    let tag = 0x5a5;
    for v in 0..VCPUS {
        for &(start, end) in work.slice(v) {
            for gpa in (start..end).step_by(4096) {
                let p = pattern(gpa, tag).to_le_bytes();
                t.write_in_region(GuestAddress(gpa), &p).unwrap();
                t.write_in_region(GuestAddress(gpa + 4092), &p).unwrap();
            }
        }
    }

    assert_eq!(work.verify(tag).unwrap().values, vec![0; VCPUS]);
    // A wrong tag fails both dwords of every page.
    let per_vcpu: Vec<u32> = (0..VCPUS)
        .map(|v| {
            work.slice(v)
                .iter()
                .map(|(a, b)| ((b - a) / 4096 * 2) as u32)
                .sum()
        })
        .collect();
    assert_eq!(work.verify(tag + 1).unwrap().values, per_vcpu);

    // One corrupted dword in vCPU 2's last slice.
    let (_, end) = *work.slice(2).last().unwrap();
    t.write_in_region(GuestAddress(end - 4), &[0xff; 4])
        .unwrap();
    assert_eq!(work.verify(tag).unwrap().values, vec![0, 0, 1, 0]);
}

#[test]
fn long_mode_guest_writes_above_4gib_and_verifies_host_writes() {
    if !common::kvm_usable() {
        return;
    }
    // 16 MiB in 4 slots from 5 GiB: out of a 32-bit guest's reach.
    let base = 5u64 << 30;
    let mut specs = guestmem_lab::vm::guest::data_specs(GuestAddress(base), 16 << 20, 4).unwrap();
    specs.push(guestmem_lab::vm::guest::control_spec());
    let map = guestmem::GuestMap::from_specs(&specs).unwrap();
    let vm = std::sync::Arc::new(
        guestmem::kvm::KvmVm::open(&guestmem::kvm::VmConfig::default()).unwrap(),
    );
    let mut slots = guestmem::kvm::Memslots::new(
        vm.clone(),
        guestmem::kvm::MemslotConfig {
            dirty_logging: guestmem::kvm::DirtyLogging::On,
            ..guestmem::kvm::MemslotConfig::default()
        },
    )
    .unwrap();
    slots.sync(&map.view()).unwrap();
    let data: Vec<_> = map.view().regions()[1..].to_vec();
    let config = WorkloadConfig {
        vcpus: 2,
        partition: Partition::PerSlot,
        mode: GuestMode::Long64,
    };
    let work = Workload::start(&vm, &map, &data, config).unwrap();

    assert_eq!(work.write_pass(3).unwrap().values, vec![3, 3]);

    let t = map.translator();
    for gpa in (base..base + (16 << 20)).step_by(4096) {
        let mut b = [0u8; 4];
        t.read_in_region(GuestAddress(gpa), &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), pattern(gpa, 3), "gpa {gpa:#x}");
        t.write_in_region(GuestAddress(gpa + 4092), &pattern(gpa, 3).to_le_bytes())
            .unwrap();
    }
    assert_eq!(work.verify(3).unwrap().values, vec![0, 0]);
    let h = slots.harvest().unwrap();
    let mut words = Vec::new();
    let mut data_pages = 0;
    for r in &data {
        slots.bitmap(r.guest_addr()).unwrap().take(&mut words);
        data_pages += guestmem::dirty::DirtyPages::new(&words).count() as u64;
    }
    assert_eq!(data_pages, (16 << 20) / 4096);
    // The rest are page-table pages: the CPU set accessed/dirty bits in the entries it used.
    slots.bitmap(GuestAddress(0)).unwrap().take(&mut words);
    let tables = PAGE_TABLES_GPA / 4096..(PAGE_TABLES_GPA + PAGE_TABLES_BYTES) / 4096;
    let control: Vec<u64> = guestmem::dirty::DirtyPages::new(&words).collect();
    assert!(control.iter().all(|p| tables.contains(p)), "{control:?}");
    assert_eq!(h.dirty_pages, data_pages + control.len() as u64);

    // A 32-bit guest refuses the same memory.
    let e = Workload::start(
        &vm,
        &map,
        &data,
        WorkloadConfig {
            mode: GuestMode::Protected32,
            ..config
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("end below"), "{e}");
}
