//! Which files a process has mapped, from the text of `/proc/<pid>/maps`: how the device
//! plugin's audit and the daemon's admission tell a process that loaded the shim
//! (`libvgpu.so`) from one that did not. Pure: the callers read the file.

use std::path::Path;

/// Whether a line of `maps` maps a file whose name is one of `names` (a path that ends in
/// ` (deleted)` counts: the library was replaced on disk after it was loaded).
pub fn maps_file_named(maps: &str, names: &[&str]) -> bool {
    maps.lines().any(|l| {
        // `addr perms offset dev inode   path`.
        let Some(path) = l.split_whitespace().nth(5) else {
            return false;
        };
        Path::new(path)
            .file_name()
            .is_some_and(|f| names.iter().any(|n| f == *n))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_library_is_found_by_its_file_name_only() {
        let maps = "7f00-7f10 r-xp 00000000 08:01 123   /usr/lib/libc.so.6\n7f20-7f30 r-xp 00000000 08:01 456   /usr/local/vgpu/libvgpu.so (deleted)\n7f40-7f50 rw-p 00000000 00:00 0 \n";
        assert!(maps_file_named(maps, &["libvgpu.so"]));
        assert!(!maps_file_named(
            "7f00-7f10 r-xp 00000000 08:01 123   /usr/lib/libvgpu.so.bak\n",
            &["libvgpu.so"]
        ));
        assert!(!maps_file_named("", &["libvgpu.so"]));
        assert!(!maps_file_named("garbage\n\n  \n", &["libvgpu.so"]));
    }
}
