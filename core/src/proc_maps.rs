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

/// How many times a CUDA driver (`libcuda.so*`) is loaded in `maps`: its mappings at file
/// offset 0, one per load. A process whose shim loaded the driver once and that then
/// loaded it again into a new link namespace (`dlmopen(LM_ID_NEWLM)`) shows 2.
pub fn driver_loads(maps: &str) -> usize {
    maps.lines()
        .filter(|l| {
            let mut f = l.split_whitespace();
            let (Some(_), Some(_), Some(offset), Some(_), Some(_), Some(path)) =
                (f.next(), f.next(), f.next(), f.next(), f.next(), f.next())
            else {
                return false;
            };
            u64::from_str_radix(offset, 16) == Ok(0)
                && Path::new(path)
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("libcuda.so"))
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_loaded_twice_is_counted_twice() {
        let once = "7f00-7f10 r--p 00000000 08:01 77   /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05\n\
                    7f10-7f90 r-xp 00010000 08:01 77   /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05\n\
                    7fa0-7fb0 r--p 00000000 08:01 88   /usr/local/vgpu/libvgpu.so\n";
        assert_eq!(driver_loads(once), 1);
        let twice = format!(
            "{once}7e00-7e10 r--p 00000000 08:01 77   /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05\n"
        );
        assert_eq!(driver_loads(&twice), 2);
        assert_eq!(
            driver_loads("7f00-7f10 r--p 00000000 08:01 9 /usr/lib/libc.so.6\n"),
            0
        );
        assert_eq!(driver_loads("garbage\n"), 0);
    }

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
