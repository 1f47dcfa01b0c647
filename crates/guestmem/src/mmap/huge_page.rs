//! Hugetlb page sizes: the sizes a mapping of hugetlb memory may have, and the flag bits
//! that ask the kernel for each.

/// A hugetlb page size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum HugePageSize {
    /// 2 MiB pages.
    #[serde(rename = "2M")]
    Size2M,
    /// 1 GiB pages.
    #[serde(rename = "1G")]
    Size1G,
}

impl HugePageSize {
    /// The page size in bytes.
    pub fn bytes(self) -> u64 {
        match self {
            HugePageSize::Size2M => 2 << 20,
            HugePageSize::Size1G => 1 << 30,
        }
    }

    /// The sysfs directory of this size's pool.
    pub fn sysfs_dir(self) -> String {
        format!(
            "/sys/kernel/mm/hugepages/hugepages-{}kB",
            self.bytes() / 1024
        )
    }

    /// The `MFD_HUGE_*` / `MAP_HUGE_*` size bits (log2 of the size, shifted).
    pub(crate) fn shift_bits(self) -> u32 {
        (self.bytes().trailing_zeros()) << 26
    }
}

impl std::fmt::Display for HugePageSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HugePageSize::Size2M => "2 MiB",
            HugePageSize::Size1G => "1 GiB",
        })
    }
}
