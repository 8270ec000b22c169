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

/// One load of a file in `maps`: its mapping at file offset 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedObject<'a> {
    /// The mapping's address range as `maps` writes it (`7f00-7f10`: the name of its entry
    /// in `/proc/PID/map_files`).
    pub range: &'a str,
    /// The file's device (`08:01`) and inode: its identity.
    pub dev: &'a str,
    /// Inode.
    pub inode: u64,
    /// Its path (possibly ending in ` (deleted)`).
    pub path: &'a str,
}

/// Every file loaded in `maps` (a mapping at offset 0 of a file with an inode and an
/// absolute path), one per load: a library loaded twice (`dlmopen`) shows twice.
pub fn loaded_objects(maps: &str) -> Vec<LoadedObject<'_>> {
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (Some(range), Some(_), Some(offset), Some(dev), Some(inode)) =
                (f.next(), f.next(), f.next(), f.next(), f.next())
            else {
                return None;
            };
            // The path is the rest of the line (it may hold spaces).
            let path = l.find(" /").map(|i| l[i + 1..].trim_end())?;
            let inode: u64 = inode.parse().ok()?;
            (u64::from_str_radix(offset, 16) == Ok(0) && inode != 0).then_some(LoadedObject {
                range,
                dev,
                inode,
                path,
            })
        })
        .collect()
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
    fn each_load_of_a_file_is_one_object_whatever_its_name() {
        let maps = "7f00-7f10 r--p 00000000 08:01 77   /usr/lib/libcuda.so.1\n\
                    7f10-7f90 r-xp 00010000 08:01 77   /usr/lib/libcuda.so.1\n\
                    7e00-7e10 r--p 00000000 08:01 99   /tmp/x/lib helper.so (deleted)\n\
                    7d00-7d10 rw-p 00000000 00:00 0 \n\
                    7c00-7c10 r--p 00000000 00:05 12   [vdso]\n";
        let o = loaded_objects(maps);
        assert_eq!(o.len(), 2, "{o:?}");
        assert_eq!(
            o[1],
            LoadedObject {
                range: "7e00-7e10",
                dev: "08:01",
                inode: 99,
                path: "/tmp/x/lib helper.so (deleted)"
            }
        );
        assert!(loaded_objects("garbage\n").is_empty());
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
