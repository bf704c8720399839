/* A prompt's own view of a reused container (the docker sandbox's -S reuse=namespace); part of namespace_init.c.
 *
 *   hermes-batch-namespace-... -O BYTES -T TAG [-L DIR] [-n] [-k CAPS] [-i UID:GID] [-w DIR] -- ARGV...
 *   hermes-batch-namespace-... -J TAG [-k CAPS] [-i UID:GID] -X
 *   hermes-batch-namespace-... -J TAG [-k CAPS] [-i UID:GID] -- ARGV...
 *
 * -O runs as the container's root, with the capabilities only it holds (SYS_ADMIN, SYS_CHROOT,
 * SYS_PTRACE, SETPCAP beyond the prompt's own; NET_ADMIN with -n, to bring the loopback up).  It makes new mount, PID, IPC and UTS namespaces
 * (with -n also a network namespace whose only interface is its loopback), writes
 * "PID STARTTIME" of the namespace's first process to the file TAG (on a container-only path
 * no view shows) and waits for it, removing TAG and TAG.stopped when it ends.  The first
 * process builds the view: a memory file system of BYTES holding the upper layer of an overlay
 * whose lower layer is the container's root (the image's files; nothing ever writes it; -L DIR: DIR, where
 * the image's files are bound because the root cannot be one, as in Apptainer's instances), a new
 * /proc with the paths Docker masks masked again, a new /dev (null zero full random urandom tty
 * bound from the container's, a new devpts, /dev/shm and /dev/mqueue), /sys read-only, copies of
 * /etc/hosts, /etc/hostname and /etc/resolv.conf, and DIR (-w) made; it moves the view onto /
 * and chroots there (Docker's seccomp profile refuses pivot_root) and starts ARGV, lowered (see lower_prompt).  It reaps orphans and ends when its
 * input hangs up (the engine closed the exec's stream: the sandbox was closed), or when ARGV ended
 * unless TAG.stopped exists; the kernel then kills everything left in its namespace.
 *
 * -J joins the namespaces of TAG's first process (checking its start time, so a pid used again is
 * never joined) and runs ARGV there, lowered the same way, as a fresh exec whose output stream no
 * process of the prompt holds; -X instead makes TAG.stopped (so the first process outlives the
 * end of ARGV) and kills every process of the namespace but its first (without a new process in
 * it when it is at its pids limit).
 */
#include <dirent.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>

#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif
#define NAMESPACE_FLAGS (CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWCGROUP | CLONE_NEWTIME)

#if defined(__x86_64__)
#define VIEW_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define VIEW_ARCH AUDIT_ARCH_AARCH64
#endif

/* What the container's extra capabilities would let Docker's seccomp profile allow, denied to the prompt: its
 * processes hold none of those capabilities, but some of these need none (user namespaces, keyrings). */
static const int denied_calls[] = {
    SYS_mount, SYS_umount2, SYS_pivot_root, SYS_unshare, SYS_setns, SYS_chroot,
#ifdef SYS_open_tree
    SYS_open_tree, SYS_move_mount, SYS_fsopen, SYS_fsconfig, SYS_fsmount, SYS_fspick,
#endif
#ifdef SYS_mount_setattr
    SYS_mount_setattr,
#endif
    SYS_bpf, SYS_perf_event_open, SYS_ptrace, SYS_process_vm_readv, SYS_process_vm_writev, SYS_kcmp,
#ifdef SYS_pidfd_getfd
    SYS_pidfd_getfd,
#endif
    SYS_sethostname, SYS_setdomainname, SYS_syslog, SYS_quotactl,
#ifdef SYS_quotactl_fd
    SYS_quotactl_fd,
#endif
    SYS_fanotify_init, SYS_lookup_dcookie, SYS_keyctl, SYS_add_key, SYS_request_key, SYS_open_by_handle_at,
    SYS_name_to_handle_at,
};

static int install_seccomp(void) {
#ifndef VIEW_ARCH
    errno = ENOSYS;
    return -1;
#else
    enum { MAX_FILTER = 128 };
    struct sock_filter filter[MAX_FILTER];
    int n = 0;
    int count = (int)(sizeof denied_calls / sizeof denied_calls[0]);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
    filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, VIEW_ARCH, 1, 0);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
#if defined(__x86_64__)
    /* x32 system calls on x86_64 have this bit: refused outright, so none escapes the list below */
    filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
#endif
    for (int i = 0; i < count; i++) { /* each: if nr == call, deny */
        filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)denied_calls[i], 0, 1);
        filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
    }
    /* clone3 passes its flags in memory, which seccomp cannot read: ENOSYS makes the C library use clone */
    filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone3, 0, 1);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS);
    /* clone with a namespace flag (its flags are the first argument on x86_64 and aarch64) */
    filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_clone, 0, 3);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0]));
    filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, NAMESPACE_FLAGS, 0, 1);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    struct sock_fprog program = {(unsigned short)n, filter};
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program, 0, 0);
#endif
}

/* In the child that becomes ARGV: the prompt's capabilities (the mask), its user (-i), no new privileges, not
 * dumpable until its exec, and the filter; -1 with errno on failure. */
static int lower_prompt(uint64_t keep) {
    for (int cap = 0; cap <= 63; cap++) {
        if (keep & (UINT64_C(1) << cap)) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) return -1;
    }
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &header, data) < 0) return -1;
    for (int i = 0; i < 2; i++) {
        data[i].effective = data[i].permitted &= (uint32_t)(keep >> (32 * i));
        data[i].inheritable = 0;
    }
    if (syscall(SYS_capset, &header, data) < 0) return -1;
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) return -1;
    if (as_uid != (uid_t)-1) { /* which clears what capabilities are left */
        if (setgroups(0, NULL) < 0 || setresgid(as_gid, as_gid, as_gid) < 0 || setresuid(as_uid, as_uid, as_uid) < 0) return -1;
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 || prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) return -1;
    return install_seccomp();
}

static void become_argv(char **command, uint64_t keep, const char *dir) {
    if (lower_prompt(keep) < 0) {
        fprintf(stderr, "hermes-batch: the prompt's command could not lower its privileges: %s\n", strerror(errno));
        _exit(126);
    }
    if (dir != NULL && chdir(dir) < 0 && chdir("/") < 0) _exit(126);
    execvp(command[0], command);
    fprintf(stderr, "hermes-batch: %s: %s\n", command[0], strerror(errno));
    _exit(127);
}

/* --- the view ---------------------------------------------------------------------------------------- */

/* The view is built under the folder of TAG, a container-only memory file system the first process covers with its
 * own in its private mount namespace (so nothing is made in the container's root), then becomes its root. */
static char view_base[PATH_MAX / 2];
static const char *view_lower = "/"; /* -L: the overlay's lower layer, the container's root unless given */

static const char *in_view(const char *path) { /* the view's path of `path`; two at a time */
    static char buffers[2][PATH_MAX];
    static int next;
    char *buffer = buffers[next++ % 2];
    snprintf(buffer, PATH_MAX, "%s/root%s", view_base, path);
    return buffer;
}

static void must_mount(const char *source, const char *target, const char *type, unsigned long flags, const char *data) {
    if (mount(source, target, type, flags, data) < 0) view_fail("mounting", target);
}

static void make_dir(const char *path, mode_t mode) {
    if (mkdir(path, mode) < 0 && errno != EEXIST) view_fail("making", path);
}

static void bind_file(const char *from, const char *to) {
    struct stat seen;
    if (stat(from, &seen) < 0) return; /* the container has no such device */
    int fd = open(to, O_WRONLY | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) view_fail("making", to);
    close(fd);
    must_mount(from, to, NULL, MS_BIND, NULL);
}

/* A copy (never a bind: a bind would let one prompt write a file the next one sees). */
static void copy_file(const char *from, const char *to) {
    char buffer[65536];
    int in = open(from, O_RDONLY | O_CLOEXEC);
    if (in < 0) return;
    unlink(to); /* whatever the image has there */
    int out = open(to, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (out < 0) view_fail("copying to", to);
    ssize_t got;
    while ((got = read(in, buffer, sizeof buffer)) > 0) {
        if (write(out, buffer, (size_t)got) != got) view_fail("copying to", to);
    }
    close(in);
    close(out);
}

static void mask_path(const char *path) {
    struct stat seen;
    if (lstat(path, &seen) < 0) return;
    if (S_ISDIR(seen.st_mode)) must_mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=0");
    else must_mount("/dev/null", path, NULL, MS_BIND, NULL);
}

static void read_only(const char *path) {
    struct stat seen;
    if (lstat(path, &seen) < 0) return;
    must_mount(path, path, NULL, MS_BIND | MS_REC, NULL);
    set_attributes(path, AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC);
}

/* A new /proc, masked as Docker masks the container's (whose masks stay with the container's own /proc). */
static void view_proc(void) {
    static const char *masked[] = {"/proc/acpi", "/proc/asound", "/proc/interrupts", "/proc/kcore", "/proc/keys",
                                   "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                                   "/proc/scsi"};
    static const char *kept_read_only[] = {"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"};
    must_mount("proc", in_view("/proc"), "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL);
    for (size_t i = 0; i < sizeof masked / sizeof masked[0]; i++) mask_path(in_view(masked[i]));
    for (size_t i = 0; i < sizeof kept_read_only / sizeof kept_read_only[0]; i++) read_only(in_view(kept_read_only[i]));
}

static void view_dev(void) {
    static const char *devices[] = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"};
    static const char *links[][2] = {{"/proc/self/fd", "/dev/fd"}, {"/proc/self/fd/0", "/dev/stdin"},
                                     {"/proc/self/fd/1", "/dev/stdout"}, {"/proc/self/fd/2", "/dev/stderr"},
                                     {"pts/ptmx", "/dev/ptmx"}};
    must_mount("tmpfs", in_view("/dev"), "tmpfs", MS_NOSUID | MS_NOEXEC, "size=65536,mode=0755");
    for (size_t i = 0; i < sizeof devices / sizeof devices[0]; i++) bind_file(devices[i], in_view(devices[i]));
    make_dir(in_view("/dev/pts"), 0755);
    int pts = mount("devpts", in_view("/dev/pts"), "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") == 0;
    make_dir(in_view("/dev/shm"), 01777);
    must_mount("tmpfs", in_view("/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=67108864,mode=1777");
    make_dir(in_view("/dev/mqueue"), 01777);
    if (mount("mqueue", in_view("/dev/mqueue"), "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) rmdir(in_view("/dev/mqueue"));
    for (size_t i = 0; i < sizeof links / sizeof links[0] - (pts ? 0 : 1); i++) {
        if (symlink(links[i][0], in_view(links[i][1])) < 0) view_fail("linking", links[i][1]);
    }
}

/* The first process builds the view and moves its root there; `dir` is made (and given to -i's user). */
static void build_container_view(const char *bytes, int network, const char *dir) {
    char options[3 * PATH_MAX];
    if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) fail("making the mounts private");
    snprintf(options, sizeof options, "size=%s,mode=0755", bytes);
    must_mount("tmpfs", view_base, "tmpfs", MS_NOSUID, options);
    snprintf(options, sizeof options, "%s/upper", view_base);
    make_dir(options, 0755);
    snprintf(options, sizeof options, "%s/work", view_base);
    make_dir(options, 0700);
    make_dir(in_view(""), 0755);
    snprintf(options, sizeof options, "lowerdir=%s,upperdir=%s/upper,workdir=%s/work", view_lower, view_base, view_base);
    must_mount("overlay", in_view(""), "overlay", 0, options);
    make_dir(in_view("/proc"), 0555);
    make_dir(in_view("/dev"), 0755);
    make_dir(in_view("/sys"), 0555);
    make_dir(in_view("/etc"), 0755);
    view_proc();
    view_dev();
    must_mount("/sys", in_view("/sys"), NULL, MS_BIND | MS_REC, NULL);
    set_attributes(in_view("/sys"), AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC);
    copy_file("/etc/hosts", in_view("/etc/hosts"));
    copy_file("/etc/hostname", in_view("/etc/hostname"));
    copy_file("/etc/resolv.conf", in_view("/etc/resolv.conf"));
    if (network) loopback_up();
    /* Docker's seccomp profile refuses pivot_root: the view is moved onto / (covering the container's root and its
     * mounts, which no process of the prompt can uncover: it may not unmount) and becomes the root, as switch_root does. */
    if (chdir(in_view("")) < 0) fail("entering the view");
    if (mount(".", "/", NULL, MS_MOVE, NULL) < 0) fail("moving the view onto /");
    if (chroot(".") < 0) fail("chroot");
    if (chdir("/") < 0) fail("chdir /");
    if (dir == NULL || dir[0] != '/' || strlen(dir) >= PATH_MAX) return;
    char partial[PATH_MAX];
    size_t length = strlen(dir);
    for (size_t i = 1; i <= length; i++) {
        if (dir[i] != '/' && dir[i] != 0) continue;
        memcpy(partial, dir, i);
        partial[i] = 0;
        if (mkdir(partial, 0755) == 0 && as_uid != (uid_t)-1 && i == length && chown(partial, as_uid, as_gid) < 0) {
            fail("giving the working folder to its user");
        }
    }
}

/* "PID STARTTIME" of a process, from its /proc/PID/stat (field 22), or 0. */
static unsigned long long start_time(pid_t pid) {
    char path[64], text[4096];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t got = read(fd, text, sizeof text - 1);
    close(fd);
    if (got <= 0) return 0;
    text[got] = 0;
    char *field = strrchr(text, ')'); /* the name may hold spaces and parentheses */
    if (field == NULL) return 0;
    for (int i = 2; i < 22 && field != NULL; i++) field = strchr(field + 1, ' ');
    return field ? strtoull(field + 1, NULL, 10) : 0;
}

static int stopped_marker(const char *tag, int make) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s.stopped", tag);
    if (!make) return access(path, F_OK) == 0;
    int fd = open(path, O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return -1;
    close(fd);
    return 0;
}

/* The first process: start ARGV, reap, end when the input hangs up or ARGV ended (unless stopped). */
static int first_process(char **command, uint64_t keep, const char *dir, int stopped_dir, const char *tag_name,
                         const sigset_t *handled, const sigset_t *mask) {
    int signals = signalfd(-1, handled, SFD_CLOEXEC | SFD_NONBLOCK);
    if (signals < 0) fail("signalfd");
    char stopped_name[PATH_MAX];
    snprintf(stopped_name, sizeof stopped_name, "%s.stopped", tag_name);
    pid_t child = fork();
    if (child < 0) fail("fork");
    if (child == 0) {
        close(signals);
        close(stopped_dir);
        sigprocmask(SIG_SETMASK, mask, NULL);
        become_argv(command, keep, dir);
    }
    /* The stream is the runner's now: the first process writes nothing more to it. */
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null >= 0) {
        dup2(null, STDOUT_FILENO);
        dup2(null, STDERR_FILENO);
    }
    struct pollfd watched[2] = {{STDIN_FILENO, 0, 0}, {signals, POLLIN, 0}};
    for (;;) {
        if (poll(watched, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        if (watched[0].revents & (POLLHUP | POLLERR | POLLNVAL)) return 0; /* the sandbox was closed */
        if (watched[1].revents) {
            struct signalfd_siginfo info;
            while (read(signals, &info, sizeof info) == sizeof info) {
            }
            int status;
            pid_t pid;
            while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
                if (pid == child && faccessat(stopped_dir, stopped_name, F_OK, 0) != 0) {
                    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                }
            }
        }
    }
}

static int container_open(const char *bytes, const char *tag, int network, uint64_t keep, const char *dir,
                          char **command) {
    int tag_fd = open(tag, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (tag_fd < 0) fail(tag);
    snprintf(view_base, sizeof view_base, "%s", tag);
    char *slash = strrchr(view_base, '/');
    const char *tag_name = slash + 1;
    char tag_copy[PATH_MAX];
    snprintf(tag_copy, sizeof tag_copy, "%s", tag_name);
    slash[slash == view_base ? 1 : 0] = 0;
    /* TAG's folder, opened before the first process covers it with the view (in the namespace both are in) */
    int tag_dir = open(view_base, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (tag_dir < 0) fail(view_base);
    int flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (network ? CLONE_NEWNET : 0);
    if (unshare(flags) < 0) fail("unshare");
    sigset_t handled, mask;
    sigemptyset(&handled);
    sigaddset(&handled, SIGCHLD);
    sigprocmask(SIG_BLOCK, &handled, &mask);
    int outer_alive[2];
    if (pipe2(outer_alive, O_CLOEXEC) < 0) fail("pipe");
    pid_t first = fork();
    if (first < 0) fail("fork");
    if (first > 0) {
        close(outer_alive[0]);
        char line[64];
        int n = snprintf(line, sizeof line, "%d %llu\n", (int)first, start_time(first));
        if (write(tag_fd, line, (size_t)n) != n) fail(tag);
        close(tag_fd);
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (null >= 0) { /* the stream ends when the namespace's last process holding it ends, and this one */
            dup2(null, STDOUT_FILENO);
            dup2(null, STDERR_FILENO);
        }
        int status;
        while (waitpid(first, &status, 0) < 0) {
            if (errno != EINTR) break;
        }
        char stopped[PATH_MAX + 8];
        snprintf(stopped, sizeof stopped, "%s.stopped", tag_copy);
        unlinkat(tag_dir, stopped, 0);
        unlinkat(tag_dir, tag_copy, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    close(tag_fd);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) fail("prctl");
    close(outer_alive[1]);
    struct pollfd outer = {outer_alive[0], POLLIN, 0};
    if (poll(&outer, 1, 0) != 0) return 125;
    close(outer_alive[0]);
    char cwd_before[PATH_MAX];
    if (dir == NULL && getcwd(cwd_before, sizeof cwd_before) != NULL) dir = cwd_before;
    int stopped_dir = tag_dir; /* where -X leaves TAG.stopped */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) fail("prctl"); /* no process of the prompt reads its fds */
    build_container_view(bytes, network, dir);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("prctl");
    return first_process(command, keep, dir, stopped_dir, tag_copy, &handled, &mask);
}

/* The first process of TAG, checked against its start time; -1 when it is gone. */
static pid_t tagged_first(const char *tag, unsigned long long *started) {
    char text[64];
    int fd = open(tag, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t got = read(fd, text, sizeof text - 1);
    close(fd);
    if (got <= 0) return -1;
    text[got] = 0;
    int pid;
    if (sscanf(text, "%d %llu", &pid, started) != 2 || pid <= 1) return -1;
    return start_time(pid) == *started ? pid : -1;
}

/* -X in a view at its pids limit (a fork bomb), where no process can be started in it to kill from inside: every
 * process its /proc shows but its first (the joined mount namespace's /proc is the view's) is killed through its
 * /proc/PID folder, which names that process and never a later one given its pid; until none is left. */
static int stop_without_fork(void) {
    for (int round = 0; round < 1000; round++) {
        DIR *proc = opendir("/proc");
        if (proc == NULL) return 125;
        int signalled = 0;
        struct dirent *entry;
        while ((entry = readdir(proc)) != NULL) {
            const char *name = entry->d_name;
            if (strspn(name, "0123456789") != strlen(name) || strcmp(name, "1") == 0) continue;
            int fd = openat(dirfd(proc), name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (fd < 0) continue;
            if (syscall(SYS_pidfd_send_signal, fd, SIGKILL, NULL, 0) == 0) signalled++;
            close(fd);
        }
        closedir(proc);
        if (signalled == 0) return 0;
        usleep(1000);
    }
    return 1;
}

/* The parent of a process (field 4 of its /proc/PID/stat), or -1. */
static pid_t parent_of(pid_t pid) {
    char path[64], text[4096];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t got = read(fd, text, sizeof text - 1);
    close(fd);
    if (got <= 0) return -1;
    text[got] = 0;
    char *field = strrchr(text, ')');
    int parent;
    return field != NULL && sscanf(field + 1, " %*c %d", &parent) == 1 ? (pid_t)parent : -1;
}

/* A namespace of the view's first process.  Without CAP_SYS_PTRACE (Apptainer's instances as root get only the
 * capabilities asked for) the first process, not dumpable, cannot be opened: its parent, the outer process of -O,
 * is in the same namespaces (it made them), its children's PID namespace being the view's. */
static int open_view_namespace(pid_t first, const char *kind) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/ns/%s", (int)first, kind);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0 || (errno != EACCES && errno != EPERM)) return fd;
    pid_t outer = parent_of(first);
    if (outer <= 1) return -1;
    snprintf(path, sizeof path, "/proc/%d/ns/%s", (int)outer, strcmp(kind, "pid") == 0 ? "pid_for_children" : kind);
    return open(path, O_RDONLY | O_CLOEXEC);
}

static int container_join(const char *tag, int stop, uint64_t keep, const char *dir, char **command) {
    static const char *kinds[] = {"ipc", "uts", "net", "pid", "mnt"};
    int fds[5];
    unsigned long long started;
    pid_t first = tagged_first(tag, &started);
    if (first < 0) {
        fprintf(stderr, "hermes-batch: the prompt's view of the container has ended\n");
        return 125;
    }
    for (int i = 0; i < 5; i++) {
        fds[i] = open_view_namespace(first, kinds[i]);
        if (fds[i] < 0) fail(kinds[i]);
    }
    if (start_time(first) != started) { /* gone, and its pid taken again, while the files were opened */
        fprintf(stderr, "hermes-batch: the prompt's view of the container has ended\n");
        return 125;
    }
    if (stop && stopped_marker(tag, 1) < 0) fail("marking the prompt stopped");
    char cwd_before[PATH_MAX];
    if (dir == NULL) dir = getcwd(cwd_before, sizeof cwd_before) ? cwd_before : "/";
    for (int i = 0; i < 5; i++) {
        if (setns(fds[i], 0) < 0) fail(kinds[i]);
        close(fds[i]);
    }
    sigset_t handled, mask;
    sigemptyset(&handled);
    sigaddset(&handled, SIGCHLD);
    sigprocmask(SIG_BLOCK, &handled, &mask);
    pid_t child = fork();
    if (child < 0 && stop && errno == EAGAIN) return stop_without_fork();
    if (child < 0) fail("fork");
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
        sigprocmask(SIG_SETMASK, &mask, NULL);
        if (!stop) become_argv(command, keep, dir);
        /* Every process of the namespace but its first, until none is left (a fork bomb's children too). */
        for (int round = 0; round < 1000; round++) {
            if (kill(-1, SIGKILL) < 0 && errno == ESRCH) _exit(0);
            usleep(1000);
        }
        _exit(1);
    }
    int status;
    while (waitpid(child, &status, 0) < 0) {
        if (errno != EINTR) return 125;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int container_main(int argc, char **argv) {
    const char *bytes = NULL, *tag = NULL, *dir = NULL;
    int join = 0, stop = 0, network = 0, option;
    uint64_t keep = 0;
    while ((option = getopt(argc, argv, "+O:J:T:L:Xnk:i:w:")) != -1) {
        if (option == 'O') bytes = optarg;
        else if (option == 'J') join = 1, tag = optarg;
        else if (option == 'T') tag = optarg;
        else if (option == 'X') stop = 1;
        else if (option == 'n') network = 1;
        else if (option == 'L') view_lower = optarg;
        else if (option == 'k') keep = strtoull(optarg, NULL, 16);
        else if (option == 'w') dir = optarg;
        else if (option == 'i') {
            unsigned u, g;
            if (sscanf(optarg, "%u:%u", &u, &g) != 2) return 125;
            as_uid = u;
            as_gid = g;
        } else return 125;
    }
    char **command = argv + optind;
    if (tag == NULL || tag[0] != '/' || (!stop && optind >= argc) || (!join && (bytes == NULL || strspn(bytes, "0123456789") != strlen(bytes)))) {
        fprintf(stderr, "usage: %s -O BYTES -T TAG [-L DIR] [-n] [-k CAPS] [-i UID:GID] [-w DIR] -- ARGV... | "
                        "-J TAG [-k CAPS] [-i UID:GID] (-X | -- ARGV...)\n", argv[0]);
        return 125;
    }
    if (join) return container_join(tag, stop, keep, dir, command);
    return container_open(bytes, tag, network, keep, dir, command);
}
