//! What happens when a region's backing is shrunk or truncated, and when a layout asks for
//! more than the host can map: the process survives, and the library refuses or names it.

use std::os::unix::fs::FileExt;

use guestmem::host::{Host, HostError};
use guestmem::vm_memory::{Bytes, GuestMemoryRegion};
use guestmem::{
    Backing, GuestAddress, GuestMap, MapError, Method, PinStrategy, PopulateConfig, RegionError,
    RegionSpec,
};

const MIB: u64 = 1 << 20;

#[test]
fn memfd_region_refuses_shrinking_and_growing_and_stays_usable() {
    let map = GuestMap::from_specs(&[
        RegionSpec::new(GuestAddress(0), 4 * MIB).with_backing(Backing::Memfd)
    ])
    .unwrap();
    let t = map.translator();
    t.write_in_region(GuestAddress(4 * MIB - 8), b"lastpage")
        .unwrap();
    let snap = map.view();
    let file = snap.regions()[0].file_offset().unwrap().file();

    for len in [0, MIB, 8 * MIB] {
        let e = file.set_len(len).unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::EPERM),
            "set_len({len:#x}): {e}"
        );
    }
    assert_eq!(file.metadata().unwrap().len(), 4 * MIB);
    // Every page is still there: the last one reads back through the translator and vm-memory.
    let mut back = [0u8; 8];
    t.read_in_region(GuestAddress(4 * MIB - 8), &mut back)
        .unwrap();
    assert_eq!(&back, b"lastpage");
    assert_eq!(
        snap.read_obj::<u64>(GuestAddress(4 * MIB - 8)).unwrap(),
        u64::from_ne_bytes(*b"lastpage")
    );
    // And through the descriptor another process would share.
    let mut via_fd = [0u8; 8];
    file.read_exact_at(&mut via_fd, 4 * MIB - 8).unwrap();
    assert_eq!(&via_fd, b"lastpage");
}

#[test]
fn memfd_seals_hold_for_a_duplicated_descriptor() {
    let map = GuestMap::from_specs(&[
        RegionSpec::new(GuestAddress(0), 2 * MIB).with_backing(Backing::Memfd)
    ])
    .unwrap();
    let snap = map.view();
    // What a VMM hands a vhost-user backend: a duplicate of the region's descriptor.
    let dup = snap.regions()[0]
        .file_offset()
        .unwrap()
        .file()
        .try_clone()
        .unwrap();
    assert_eq!(
        dup.set_len(0).unwrap_err().raw_os_error(),
        Some(libc::EPERM)
    );
    map.translator()
        .write_in_region(GuestAddress(2 * MIB - 1), &[7])
        .unwrap();
}

/// A caller's file, truncated behind guestmem's back: touching the lost pages from the CPU
/// would raise `SIGBUS`, so this test never does; it shows what the library reports instead.
#[test]
fn file_region_truncated_by_someone_else_is_named_not_a_signal() {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("guestmem-truncate-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; (8 * MIB) as usize]).unwrap();
    let spec = RegionSpec::new(GuestAddress(0x10_0000_0000), 4 * MIB).with_backing(Backing::File {
        path: path.clone(),
        offset: 4 * MIB,
    });
    let map = GuestMap::from_specs(&[spec]).unwrap();
    let snap = map.view();
    assert!(snap.regions()[0].check_backing().is_ok());

    // Someone else shrinks the file to 5 MiB: 3 MiB of the region are gone.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(5 * MIB)
        .unwrap();

    let e = snap.regions()[0].check_backing().unwrap_err();
    assert!(
        matches!(e, RegionError::FileTooShort { file_len, needed, .. } if file_len == 5 * MIB && needed == 8 * MIB),
        "{e}"
    );
    // Populating it fails with an error naming the file, for both methods, and the process
    // is still here to read it.
    for method in [Method::PopulateWrite, Method::Touch] {
        let cfg = PopulateConfig {
            threads: 1,
            method,
            pin: PinStrategy::None,
            ..PopulateConfig::default()
        };
        let e = guestmem::populate(&snap, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("region at 0x1000000000")
                && e.contains(&path.display().to_string())
                && e.contains("0x500000"),
            "{method:?}: {e}"
        );
    }
    // The part that is still backed is readable.
    assert_eq!(
        snap.regions()[0]
            .get_slice(guestmem::vm_memory::MemoryRegionAddress(0), 8)
            .unwrap()
            .read_obj::<u64>(0)
            .unwrap(),
        0
    );
    drop(snap);
    drop(map);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn layout_past_max_map_count_is_refused_before_mapping() {
    let host = Host::read();
    let Some(limit) = host.max_map_count else {
        guestmem_testkit::skip(format_args!("vm.max_map_count is unreadable here"));
        return;
    };
    // Each guarded region adds 3 mappings: enough regions to pass the limit.
    let n = (limit.saturating_sub(host.map_count) / 3 + 1) as usize;
    if n > guestmem::MAX_REGIONS {
        guestmem_testkit::skip(format_args!(
            "vm.max_map_count ({limit}) allows more regions than a map holds"
        ));
        return;
    }
    let specs: Vec<RegionSpec> = (0..n as u64)
        .map(|i| RegionSpec::new(GuestAddress(i * 2 * MIB), 4096))
        .collect();
    let before = Host::read().map_count;
    let e = GuestMap::from_specs(&specs).unwrap_err();
    assert!(
        matches!(&e, MapError::Host(HostError::MapCount { needed, limit: l, .. }) if *needed == 3 * n as u64 && *l == limit),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("vm.max_map_count") && msg.contains(&limit.to_string()),
        "{msg}"
    );
    // Nothing was mapped (other tests may map meanwhile, but never thousands).
    assert!(Host::read().map_count < before + 100);
}

#[test]
fn file_offset_errors_name_the_offset() {
    let path = std::env::temp_dir().join(format!("guestmem-offset-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    let with_offset = |offset| {
        RegionSpec::new(GuestAddress(0), 4096).with_backing(Backing::File {
            path: path.clone(),
            offset,
        })
    };
    let e = guestmem::Region::map(&with_offset(1)).unwrap_err();
    assert!(
        matches!(
            e,
            RegionError::UnalignedFileOffset {
                offset: 1,
                page: 4096,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("file offset 0x1 is not a multiple"),
        "{e}"
    );

    let e = guestmem::Region::map(&with_offset(u64::MAX - 4095)).unwrap_err();
    assert!(matches!(e, RegionError::FileRangeOverflow { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("file offset 0xfffffffffffff000") && !msg.contains("guest range"),
        "{msg}"
    );
    std::fs::remove_file(&path).unwrap();
}

/// Whether a region's descriptor reaches the guest's memory itself (`is_shared`): a memfd's
/// and a file mapped shared do; a file mapped private does not (its descriptor reaches the
/// file, not the guest's copy on write), though it has a descriptor too; anonymous memory
/// has none.
#[test]
fn only_a_shared_backing_is_shared() {
    let dir = guestmem_testkit::Scratch::new("backing-shared");
    let path = dir.join("mem");
    std::fs::write(&path, vec![0u8; 2 * MIB as usize]).unwrap();
    let file = |private: bool| {
        let (path, offset) = (path.clone(), 0);
        if private {
            Backing::FilePrivate { path, offset }
        } else {
            Backing::File { path, offset }
        }
    };
    for (backing, shared, has_fd) in [
        (Backing::Anonymous, false, false),
        (Backing::Memfd, true, true),
        (file(false), true, true),
        (file(true), false, true),
    ] {
        let spec = RegionSpec::new(GuestAddress(0), 2 * MIB).with_backing(backing.clone());
        let map = GuestMap::from_specs(&[spec]).unwrap();
        let view = map.view();
        let r = &view.regions()[0];
        assert_eq!(r.is_shared(), shared, "{backing:?}");
        assert_eq!(r.file_offset().is_some(), has_fd, "{backing:?}");
    }
}

/// Only a regular file backs a region: a device or special file may map, but its pages need
/// not read and write as memory, nor stay (a PCI BAR's sysfs resource, `/dev/zero`).
#[test]
fn a_device_file_is_refused_as_a_backing() {
    let spec = RegionSpec::new(GuestAddress(0), 4096).with_backing(Backing::File {
        path: "/dev/zero".into(),
        offset: 0,
    });
    let e = GuestMap::from_specs(&[spec]).unwrap_err().to_string();
    assert!(
        e.contains("/dev/zero") && e.contains("not a regular file"),
        "{e}"
    );
}

/// A pseudo-file system's regular file (sysfs reports 4096 bytes for an attribute, as a
/// PCI BAR's `resourceN` reports its size) is refused, naming the file system.
#[test]
fn a_sysfs_file_is_refused_as_a_backing() {
    let path = std::path::PathBuf::from("/sys/kernel/mm/transparent_hugepage/enabled");
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() && m.len() >= 4096 => {}
        _ => {
            return guestmem_testkit::skip(format!(
                "{} is not here as a 4 KiB regular file",
                path.display()
            ))
        }
    }
    let spec = RegionSpec::new(GuestAddress(0), 4096)
        .with_access(guestmem::layout::Access::ReadOnly)
        .with_backing(Backing::FilePrivate { path, offset: 0 });
    let e = GuestMap::from_specs(&[spec]).unwrap_err().to_string();
    assert!(e.contains("sysfs"), "{e}");
}
