/*
passthrough.h: FUSE passthrough (kernel >= 6.9, libfuse >= 3.17.4) for pyfuse3.

Added by ckptfs (not part of pyfuse3 3.5.0). With passthrough, an open of a file may name a
"backing" file in the daemon's own file system: the kernel then does that handle's reads and
writes (and mmap) on the backing file itself, and the daemon never sees the bytes.

Against an older libfuse this compiles to stubs that say "not supported".

This work may be distributed under the terms of the GNU LGPL.
*/

#include <errno.h>
#include <stdint.h>
#include <sys/ioctl.h>

#if defined(FUSE_MAJOR_VERSION) && defined(FUSE_HOTFIX_VERSION) && \
    (FUSE_MAJOR_VERSION > 3 || (FUSE_MAJOR_VERSION == 3 && \
     (FUSE_MINOR_VERSION > 17 || (FUSE_MINOR_VERSION == 17 && FUSE_HOTFIX_VERSION >= 4))))
/* 3.17.1-3.17.3 convert conn->want to want_ext wrongly: passthrough needs 3.17.4. */
#define PYFUSE3_PASSTHROUGH 1
#else
#define PYFUSE3_PASSTHROUGH 0
#endif

/* The kernel's ioctls on /dev/fuse (include/uapi/linux/fuse.h), defined here because the
   build host's kernel headers may predate them. */
struct pyfuse3_backing_map {
    int32_t fd;
    uint32_t flags;
    uint64_t padding;
};
#define PYFUSE3_IOC_BACKING_OPEN _IOW(229, 1, struct pyfuse3_backing_map)
#define PYFUSE3_IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)

#if PYFUSE3_PASSTHROUGH
/* Ask for passthrough at INIT; 1 if the kernel offers it. `depth`: how many stacked file
   systems (overlayfs...) the backing files may sit on. */
static int pyfuse3_want_passthrough(struct fuse_conn_info *conn, unsigned depth) {
    if (!fuse_set_feature_flag(conn, FUSE_CAP_PASSTHROUGH))
        return 0;
    conn->max_backing_stack_depth = depth;
    return 1;
}
static void pyfuse3_set_backing_id(struct fuse_file_info *fi, int backing_id) {
    fi->backing_id = backing_id;
}
#else
static int pyfuse3_want_passthrough(struct fuse_conn_info *conn, unsigned depth) {
    (void)conn; (void)depth;
    return 0;
}
static void pyfuse3_set_backing_id(struct fuse_file_info *fi, int backing_id) {
    (void)fi; (void)backing_id;
}
#endif

/* Register `fd` as a backing file: its id (> 0), or -errno. */
static int pyfuse3_backing_open(int session_fd, int fd) {
    struct pyfuse3_backing_map map = { .fd = fd, .flags = 0, .padding = 0 };
    int ret = ioctl(session_fd, PYFUSE3_IOC_BACKING_OPEN, &map);
    return ret < 0 ? -errno : ret;
}

/* Drop a backing id (open handles keep their backing file): 0, or -errno. */
static int pyfuse3_backing_close(int session_fd, int backing_id) {
    uint32_t id = (uint32_t)backing_id;
    int ret = ioctl(session_fd, PYFUSE3_IOC_BACKING_CLOSE, &id);
    return ret < 0 ? -errno : 0;
}
