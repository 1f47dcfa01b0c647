//! `s3://BUCKET/NAME`: which bucket, and which snapshot in it.

use super::StoreError;

/// A snapshot's place in object storage: `s3://BUCKET/NAME`. NAME may hold `/` (a folder
/// of snapshots), never `..`, an empty part, or a character outside `[A-Za-z0-9._-/]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StoreUrl {
    /// The bucket.
    pub bucket: String,
    /// The snapshot's name in it (empty for a URL that names the bucket only).
    pub name: String,
}

/// Where a snapshot's manifest is kept, under its name.
pub(crate) const SNAPSHOTS: &str = "snapshots/";
/// Where frames are kept, under their BLAKE3 hash in hex.
pub(crate) const FRAMES: &str = "frames/";
/// Where pushes in progress keep their leases.
pub(crate) const LEASES: &str = "leases/";

impl StoreUrl {
    /// Whether `s` is meant as a store URL (it starts `s3://`).
    pub fn is_store_url(s: &str) -> bool {
        s.starts_with("s3://")
    }

    /// Parses `s3://BUCKET/NAME` (or `s3://BUCKET` with `allow_bare`).
    pub fn parse(s: &str, allow_bare: bool) -> Result<StoreUrl, StoreError> {
        let bad = |reason| StoreError::Url {
            url: s.to_string(),
            reason,
        };
        let rest = s
            .strip_prefix("s3://")
            .ok_or_else(|| bad("not an s3:// URL"))?;
        let (bucket, name) = rest.split_once('/').unwrap_or((rest, ""));
        let name = name.trim_end_matches('/');
        // S3's bucket naming rules: 3-63 of lowercase letters, digits, '.', '-'.
        if bucket.len() < 3
            || bucket.len() > 63
            || !bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        {
            return Err(bad("the bucket must be 3 to 63 of a-z, 0-9, '.' and '-'"));
        }
        if name.is_empty() {
            if allow_bare {
                return Ok(StoreUrl {
                    bucket: bucket.into(),
                    name: String::new(),
                });
            }
            return Err(bad("no snapshot name after the bucket"));
        }
        if name.len() > 512 {
            return Err(bad("the name is longer than 512 bytes"));
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b))
        {
            return Err(bad(
                "the name must be of A-Z, a-z, 0-9, '.', '_', '-' and '/'",
            ));
        }
        if name
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
        {
            return Err(bad("the name has an empty, '.' or '..' part"));
        }
        Ok(StoreUrl {
            bucket: bucket.into(),
            name: name.into(),
        })
    }

    /// The key of this snapshot's manifest.
    pub(crate) fn manifest_key(&self) -> String {
        format!("{SNAPSHOTS}{}/manifest.json", self.name)
    }

    /// Another snapshot in the same bucket.
    pub fn sibling(&self, name: &str) -> StoreUrl {
        StoreUrl {
            bucket: self.bucket.clone(),
            name: name.into(),
        }
    }

    /// `s3://bucket/key`, for messages.
    pub(crate) fn object(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.bucket)
    }
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.name)
    }
}

/// The key of the frame of `hash`.
pub(crate) fn frame_key(hash: &blake3::Hash) -> String {
    format!("{FRAMES}{}", hash.to_hex())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_bucket_and_a_snapshot() {
        let u = StoreUrl::parse("s3://my-bucket/vms/base.1", false).unwrap();
        assert_eq!(u.bucket, "my-bucket");
        assert_eq!(u.name, "vms/base.1");
        assert_eq!(u.manifest_key(), "snapshots/vms/base.1/manifest.json");
        assert_eq!(u.to_string(), "s3://my-bucket/vms/base.1");
        for bad in [
            "http://b/x",
            "s3://B/x",
            "s3://ab/x",
            "s3://bucket",
            "s3://bucket/../x",
            "s3://bucket/a//b",
            "s3://bucket/a b",
        ] {
            assert!(StoreUrl::parse(bad, false).is_err(), "{bad}");
        }
        assert_eq!(StoreUrl::parse("s3://bucket/", true).unwrap().name, "");
    }
}
