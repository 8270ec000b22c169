//! Publishing a shared file complete or not at all: the creator builds the whole file
//! under a private name, then links it into place with `link(2)`, which never replaces an
//! existing file. A racing process sees either no file or a complete one, and of several
//! racing creators the first link wins; the others open the winner's file.

use std::io;
use std::path::Path;

/// Links the complete file `tmp` into place at `path`, then removes `tmp` (whatever the
/// outcome). A file already at `path` is success: another creator published first.
pub fn publish_by_link(tmp: &Path, path: &Path) -> io::Result<()> {
    let linked = std::fs::hard_link(tmp, path);
    let _ = std::fs::remove_file(tmp);
    match linked {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_file_wins_and_private_names_go_away() {
        let dir = std::env::temp_dir().join(format!("vgpu-sys-publish-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let path = dir.join("state.bin");
        let (a, b) = (dir.join(".a.tmp"), dir.join(".b.tmp"));
        std::fs::write(&a, "first").expect("write a");
        std::fs::write(&b, "second").expect("write b");
        publish_by_link(&a, &path).expect("publish a");
        publish_by_link(&b, &path).expect("a published file is success");
        assert_eq!(std::fs::read_to_string(&path).expect("read"), "first");
        assert!(!a.exists() && !b.exists());
        let missing = publish_by_link(&dir.join(".none.tmp"), &dir.join("other.bin"));
        assert_eq!(missing.map_err(|e| e.kind()), Err(io::ErrorKind::NotFound));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
