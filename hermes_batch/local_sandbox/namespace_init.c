/* The first process of a local sandbox's namespace, which starts the prompt's commands.
 *
 * hermes-batch builds this file with the machine's C compiler the first time a
 * run needs it (see namespace_init.py) and otherwise uses unshare, setpriv and
 * a bash helper, which do the same in three programs.  It speaks the same
 * protocol as that helper (launchers.HELPER):
 *
 * Inside a container it is also the first process of each prompt's own view of
 * the container (-O and -J, see namespace_view.h).
 *
 *   hermes-batch-namespace-... [-u] [-k CAPS] [-m MAX] [-i UID:GID] [-n]
 *       [-r ROOT [-t BYTES] [-h PATH]... [-e PATH[:rw]]...] [-M BYTES] [-P COUNT] [-F BYTES] [-C SECONDS]
 *       CONTROL CWD SPILL
 *
 * It makes a PID, mount and IPC namespace (with -u also a user namespace mapping the
 * caller's uid and gid onto themselves, for a caller without root; with -n also
 * a network namespace whose only interface is its own loopback, to which the runner
 * may attach a user-mode NAT program: see nat.py), forks the
 * namespace's first process and waits for it, exiting as it does; if this
 * outer process dies, the first process is killed (as unshare --kill-child).
 *
 * The first process builds the commands' view of the files with -r: the whole
 * file system read-only and nosuid; ROOT (the prompt's folder) writable at its
 * own path; a private /tmp and /dev/shm (memory file systems of -t BYTES, 64 MiB
 * by default); every -h PATH (a folder) under an empty read-only folder, so
 * nothing in it is seen; every -e PATH seen at its own path (read-only unless
 * :rw), also inside a hidden folder.  It mounts the namespace's own /proc and
 * /dev/mqueue (System V shared memory held to the size of /tmp), takes a session
 * keyring of its own, shows only its name as its command line, and
 * lowers its privileges (no new privileges, not dumpable; with -k, the
 * capability bounding set and its own capabilities reduced to the hexadecimal
 * mask CAPS, which its commands then keep as root and lose otherwise).  With
 * -i (root only) each command instead runs as UID and GID, with no
 * supplementary groups and no capabilities at all (the first process keeps only
 * those it needs for that: setuid, setgid, setpcap and kill).  Each command
 * starts with the resource limits -M (address space), -P (processes of its
 * user), -F (size of a file it writes) and -C (CPU seconds), where given.
 * Then it says "ready" and reads requests on its input, one per line:
 *
 *   ID      run the command written in CONTROL/ID.sh in CWD, its output (and
 *           errors) to the FIFO CONTROL/ID.out, its input /dev/null, with
 *           /bin/sh -c, in a process group of its own; both files are
 *           removed once opened
 *   dID     the same in SPILL
 *   kPGID   SIGKILL the process group PGID
 *
 * and answers "p ID PGID" once a command started and "x ID STATUS" once it
 * ended (its exit status, 128 + the signal's number when a signal ended it).
 * A command that cannot start (its fork failed, or MAX commands, 4096 by
 * default, are running) gets only "x ID 126", and its FIFO says why.
 * It reaps every orphan of the namespace.  When its input ends (the runner
 * closed it or died) it exits, and on SIGTERM or SIGINT from outside the namespace
 * (a command's are ignored) it exits with 128 + the signal's number; the kernel then
 * kills everything left in the namespace.  Its commands may not call keyctl, add_key
 * or request_key (a seccomp filter).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/capability.h>

#define MAX_COMMANDS 4096 /* commands running at once in one namespace (-m, at most this); more are refused */
#define MAX_ID 64
#define MAX_PATHS 64 /* -h and -e options, each */

/* The new mount API (Linux 5.2, mount_setattr 5.12), called directly: older C libraries lack the wrappers. */
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#define MOUNT_ATTR_NOSUID 0x00000002
#define MOUNT_ATTR_NODEV 0x00000004
#endif
struct view_mount_attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

static int dirfds[2];        /* the parents of CONTROL and SPILL, opened before the view hides them */
static const char *names[2]; /* the names of CONTROL and SPILL in them */
static const char *cwd;
static int max_commands = MAX_COMMANDS;
static uid_t as_uid = (uid_t)-1; /* -i: the commands' user and group */
static gid_t as_gid = (gid_t)-1;
static uid_t grader_uid = (uid_t)-1; /* -g: as root, the user the verifier's tests run as (see grading.h) */
static gid_t grader_gid = (gid_t)-1;
static const char *view_root;        /* -r */
static char tmp_options[64] = "size=67108864,mode=1777";
static uint64_t kept; /* the capabilities the first process kept in its bounding set (all others it dropped) */
static struct {
    int resource;
    rlim_t value;
    int set;
} limits[] = {{RLIMIT_AS, 0, 0}, {RLIMIT_NPROC, 0, 0}, {RLIMIT_FSIZE, 0, 0}, {RLIMIT_CPU, 0, 0}};

struct command {
    pid_t pid;
    char id[MAX_ID + 1];
};
static struct command commands[MAX_COMMANDS];

static void fail(const char *what) {
    fprintf(stderr, "hermes-batch-namespace: %s: %s\n", what, strerror(errno));
    exit(125);
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) fail(path);
    close(fd);
}

static void answer(char kind, const char *id, long value) {
    char line[MAX_ID + 48];
    int n = snprintf(line, sizeof line, "%c %s %ld\n", kind, id, value);
    while (write(STDOUT_FILENO, line, n) < 0 && errno == EINTR) {
    }
}

/* The capability bounding set, and this process's own capabilities, down to the mask `keep`. */
static void lower_capabilities(uint64_t keep) {
    for (int cap = 0; cap <= 63; cap++) {
        if (keep & (UINT64_C(1) << cap)) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) fail("dropping a capability");
    }
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &header, data) < 0) fail("reading capabilities");
    for (int i = 0; i < 2; i++) { /* what it does not have it cannot keep */
        data[i].effective = data[i].permitted &= (uint32_t)(keep >> (32 * i));
        data[i].inheritable = 0;
    }
    if (syscall(SYS_capset, &header, data) < 0) fail("lowering capabilities");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) fail("clearing ambient capabilities");
}

/* In the child, as root with -i: the command's own user and group, no groups, no capabilities left to gain. */
static int drop_identity(void) {
    for (int cap = 0; cap <= 63; cap++) { /* the rest went once per namespace: a drop each costs a microsecond */
        if (!(kept & (UINT64_C(1) << cap))) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) return -1;
    }
    if (setgroups(0, NULL) < 0 || setresgid(as_gid, as_gid, as_gid) < 0) return -1;
    if (setresuid(as_uid, as_uid, as_uid) < 0) return -1; /* which clears its capabilities */
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) < 0) return -1;
    return prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL ? -1 : 0;
}

/* In the child: become the command, or exit 126 (no folder, no identity) or 127 (no shell). */
static void become(int spilled, const char *id, const sigset_t *mask) {
    char path[PATH_MAX];
    sigprocmask(SIG_SETMASK, mask, NULL);
    setpgid(0, 0);
    int null = open("/dev/null", O_RDONLY);
    snprintf(path, sizeof path, "%s/%s.out", names[spilled], id);
    int out = openat(dirfds[spilled], path, O_WRONLY | O_NOFOLLOW); /* the FIFO the runner holds open to read */
    if (null < 0 || out < 0) _exit(126);
    unlinkat(dirfds[spilled], path, 0); /* here, not in the runner, whose event loop it cost a tenth of a millisecond */
    dup2(null, STDIN_FILENO);
    dup2(out, STDOUT_FILENO);
    dup2(out, STDERR_FILENO);
    if (null > STDERR_FILENO) close(null);
    if (out > STDERR_FILENO) close(out);
    snprintf(path, sizeof path, "%s/%s.sh", names[spilled], id);
    int script = openat(dirfds[spilled], path, O_RDONLY | O_NOFOLLOW);
    struct stat shown;
    if (script < 0 || fstat(script, &shown) < 0) _exit(126);
    char *text = malloc((size_t)shown.st_size + 1);
    size_t size = 0;
    ssize_t got = 1;
    while (text && size < (size_t)shown.st_size && got != 0) {
        got = read(script, text + size, (size_t)shown.st_size - size);
        if (got < 0) {
            if (errno == EINTR) continue;
            _exit(126);
        }
        size += got;
    }
    if (!text) _exit(126);
    text[size] = 0;
    close(script);
    unlinkat(dirfds[spilled], path, 0);
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        struct rlimit limit = {limits[i].value, limits[i].value};
        if (limits[i].set && setrlimit(limits[i].resource, &limit) < 0) {
            fprintf(stderr, "hermes-batch: the command's limits could not be set: %s\n", strerror(errno));
            _exit(126);
        }
    }
    if (as_uid != (uid_t)-1 && drop_identity() < 0) {
        fprintf(stderr, "hermes-batch: the command could not drop its privileges: %s\n", strerror(errno));
        _exit(126);
    }
    if (chdir(cwd) < 0) { /* as the command's user, whose folder it is */
        fprintf(stderr, "hermes-batch: the command cannot enter its folder %s: %s\n", cwd, strerror(errno));
        _exit(126);
    }
    execl("/bin/sh", "sh", "-c", text, (char *)NULL);
    fprintf(stderr, "/bin/sh: %s\n", strerror(errno));
    _exit(127);
}

/* A command that cannot start: why, through its FIFO (so the runner's read ends at once), and status 126. */
static void refuse(int spilled, const char *id, const char *why) {
    char path[PATH_MAX], line[256];
    snprintf(path, sizeof path, "%s/%s.out", names[spilled], id);
    int out = openat(dirfds[spilled], path, O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (out >= 0) {
        int n = snprintf(line, sizeof line, "hermes-batch: the command could not start (%s)\n", why);
        if (write(out, line, n) < 0) {
        }
        close(out);
    }
    answer('x', id, 126);
}

static void start_grading(const char *id, const sigset_t *mask); /* grading.h */

static void start(const char *request, const sigset_t *mask) {
    int spilled = request[0] == 'd';
    const char *id = request + spilled;
    size_t length = strlen(id);
    if (length == 0 || length > MAX_ID || strchr(id, '/') || strchr(id, ' ')) return;
    int slot = 0;
    while (slot < max_commands && commands[slot].pid != 0) slot++;
    if (slot == max_commands) {
        refuse(spilled, id, "too many commands at once");
        return;
    }
    pid_t pid = fork();
    if (pid < 0) {
        refuse(spilled, id, strerror(errno));
        return;
    }
    if (pid == 0) become(spilled, id, mask);
    setpgid(pid, pid); /* as the child does: whichever runs first */
    commands[slot].pid = pid;
    memcpy(commands[slot].id, id, length + 1);
    answer('p', id, pid);
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int slot = 0; slot < max_commands; slot++) {
            if (commands[slot].pid != pid) continue;
            long code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            answer('x', commands[slot].id, code);
            commands[slot].pid = 0;
            break;
        }
    }
}

/* Whether a signal came from outside the namespace (the runner, an administrator, the kernel): a process of the
 * namespace has a pid there, and may not forge a kill()'s or the kernel's code (rt_sigqueueinfo refuses both), so a
 * command's `kill -TERM 1` never ends the namespace under the prompt. */
static int from_outside(const struct signalfd_siginfo *info) {
    return info->ssi_pid == 0 && (info->ssi_code == SI_USER || info->ssi_code == SI_KERNEL);
}

/* The request loop; `handled` are the signals it reads (blocked), `mask` what its commands start with. */
static int serve(const sigset_t *handled, const sigset_t *mask) {
    int signals = signalfd(-1, handled, SFD_CLOEXEC | SFD_NONBLOCK);
    if (signals < 0) fail("signalfd");
    if (write(STDOUT_FILENO, "ready\n", 6) != 6) return 1;
    char buffer[4096];
    size_t used = 0;
    struct pollfd watched[2] = {{STDIN_FILENO, POLLIN, 0}, {signals, POLLIN, 0}};
    for (;;) {
        if (poll(watched, 2, -1) < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        if (watched[1].revents) {
            struct signalfd_siginfo info;
            int ended = 0;
            while (read(signals, &info, sizeof info) == sizeof info) {
                if (info.ssi_signo != SIGCHLD && from_outside(&info)) ended = 128 + (int)info.ssi_signo;
            }
            reap();
            if (ended) return ended;
        }
        if (watched[0].revents) {
            ssize_t got = read(STDIN_FILENO, buffer + used, sizeof buffer - 1 - used);
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) return 0; /* the runner closed our input, or died */
            used += got;
            char *line = buffer, *end;
            while ((end = memchr(line, '\n', buffer + used - line)) != NULL) {
                *end = 0;
                if (line[0] == 'k') {
                    char *rest;
                    long pgid = strtol(line + 1, &rest, 10);
                    if (*rest == 0 && pgid > 1) kill(-pgid, SIGKILL);
                } else if (line[0] == 'g') {
                    start_grading(line + 1, mask);
                } else {
                    start(line, mask);
                }
                line = end + 1;
            }
            used = buffer + used - line;
            memmove(buffer, line, used);
            if (used == sizeof buffer - 1) used = 0; /* a line longer than any request: dropped */
        }
    }
}

/* --- the commands' view of the files (-r) ----------------------------------------------------------- */

static const char *hidden[MAX_PATHS], *exposed[MAX_PATHS];
static int exposed_rw[MAX_PATHS], exposed_fd[MAX_PATHS];
static int hidden_count, exposed_count;

static void view_fail(const char *what, const char *path) {
    fprintf(stderr, "hermes-batch-namespace: %s %s: %s\n", what, path, strerror(errno));
    exit(125);
}

static void set_attributes(const char *path, unsigned flags, uint64_t set) {
    struct view_mount_attr attr = {set, 0, 0, 0};
    if (syscall(SYS_mount_setattr, AT_FDCWD, path, flags, &attr, sizeof attr) < 0) view_fail("setting the mount of", path);
}

/* The folders up to `path` (they are made only inside the view's own memory file systems), and, when
 * `file`, an empty file there to mount a file on. */
static void make_path(const char *path, int file) {
    char partial[PATH_MAX];
    size_t length = strlen(path);
    if (length >= sizeof partial) view_fail("a path too long:", path);
    for (size_t i = 1; i <= length; i++) {
        if (path[i] != '/' && path[i] != 0) continue;
        memcpy(partial, path, i);
        partial[i] = 0;
        struct stat seen;
        if (stat(partial, &seen) == 0) continue;
        if (i == length && file) {
            int fd = open(partial, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0444);
            if (fd < 0) view_fail("making", partial);
            close(fd);
        } else if (mkdir(partial, 0755) < 0 && errno != EEXIST) {
            view_fail("making", partial);
        }
    }
}

static int clone_tree(const char *path) {
    int fd = (int)syscall(SYS_open_tree, AT_FDCWD, path, OPEN_TREE_CLONE | AT_RECURSIVE | O_CLOEXEC);
    if (fd < 0) view_fail("cloning the mount of", path);
    return fd;
}

static void attach(int tree, const char *path) {
    struct stat seen;
    if (fstat(tree, &seen) < 0) view_fail("reading", path);
    make_path(path, !S_ISDIR(seen.st_mode));
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, path, MOVE_MOUNT_F_EMPTY_PATH) < 0) view_fail("mounting", path);
    close(tree);
}

static void memory_folder(const char *path, const char *options, unsigned long flags) {
    if (mount("tmpfs", path, "tmpfs", flags | MS_NOSUID | MS_NODEV, options) < 0) view_fail("mounting a folder on", path);
}

struct place {
    const char *path;
    int exposed; /* the index of an -e path, else -1: an -h folder */
};

static int shorter(const void *a, const void *b) {
    size_t x = strlen(((const struct place *)a)->path), y = strlen(((const struct place *)b)->path);
    return x < y ? -1 : x > y;
}

/* Everything read-only but `root`, the private /tmp and /dev/shm, and -e PATH:rw; -h folders empty.  The -h and
 * -e places are mounted shortest first, so a place inside another is mounted on it: a folder exposed inside a
 * hidden one is seen, a folder hidden inside an exposed one is not; the prompt's folder goes on last. */
static void build_view(const char *root, const char *tmp_options) {
    struct stat seen;
    struct place places[2 * MAX_PATHS];
    int count = 0, mounted[2 * MAX_PATHS] = {0};
    int root_tree = clone_tree(root); /* taken before anything hides it */
    for (int i = 0; i < exposed_count; i++) {
        exposed_fd[i] = clone_tree(exposed[i]);
        places[count++] = (struct place){exposed[i], i};
    }
    for (int i = 0; i < hidden_count; i++) places[count++] = (struct place){hidden[i], -1};
    qsort(places, count, sizeof places[0], shorter);
    set_attributes("/", AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID);
    memory_folder("/tmp", tmp_options, 0);
    if (stat("/dev/shm", &seen) == 0 && S_ISDIR(seen.st_mode)) memory_folder("/dev/shm", tmp_options, 0);
    for (int i = 0; i < count; i++) {
        int e = places[i].exposed;
        if (e >= 0) {
            attach(exposed_fd[e], exposed[e]);
            set_attributes(exposed[e], AT_RECURSIVE,
                           MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (exposed_rw[e] ? 0 : MOUNT_ATTR_RDONLY));
            continue;
        }
        if (stat(places[i].path, &seen) < 0) {
            if (errno == ENOENT) continue; /* not there, or inside a folder hidden already */
            view_fail("reading", places[i].path);
        }
        if (!S_ISDIR(seen.st_mode)) { /* a file (the dataset): covered by a device none of its commands may open */
            if (mount("/dev/null", places[i].path, NULL, MS_BIND, NULL) < 0) view_fail("hiding", places[i].path);
            set_attributes(places[i].path, 0, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID);
            continue;
        }
        memory_folder(places[i].path, "size=65536,mode=0755", MS_NOEXEC);
        mounted[i] = 1;
    }
    attach(root_tree, root);
    for (int i = 0; i < count; i++) {
        if (mounted[i]) set_attributes(places[i].path, 0, MOUNT_ATTR_RDONLY);
    }
}

/* With -n: the network namespace's loopback up (its only interface). */
static void loopback_up(void) {
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq request;
    memset(&request, 0, sizeof request);
    strcpy(request.ifr_name, "lo");
    if (fd < 0 || ioctl(fd, SIOCGIFFLAGS, &request) < 0) fail("reading the loopback");
    request.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(fd, SIOCSIFFLAGS, &request) < 0) fail("bringing the loopback up");
    close(fd);
}

/* The parent of a control folder, opened before the view hides it, and the folder's name in it. */
static void open_control(int which, const char *path) {
    static char parents[2][PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (slash == NULL || slash[1] == 0 || (size_t)(slash - path) >= PATH_MAX) {
        errno = EINVAL;
        fail(path);
    }
    memcpy(parents[which], path, slash - path);
    parents[which][slash == path ? 1 : slash - path] = 0;
    dirfds[which] = open(parents[which], O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dirfds[which] < 0) fail(parents[which]);
    names[which] = slash + 1;
}

static int size_option(const char *text, rlim_t *value) {
    char *rest;
    errno = 0;
    unsigned long long parsed = strtoull(text, &rest, 10);
    if (errno || *rest || rest == text) return -1;
    *value = (rlim_t)parsed;
    return 0;
}

#include "namespace_view.h"
#include "grading.h"

/* What /proc/PID/cmdline shows of this program: its options name the folders it hides (the run folder, the home,
 * the helper's own path in the cache), and any process of the namespace may read its first process's command
 * line.  The arguments are copied, and the memory the kernel shows is overwritten with the bare name. */
static char **hide_arguments(int argc, char **argv) {
    if (argc < 1) return argv;
    char **copy = calloc((size_t)argc + 1, sizeof *copy);
    if (copy == NULL) fail("copying the arguments");
    for (int i = 0; i < argc; i++) {
        copy[i] = strdup(argv[i]);
        if (copy[i] == NULL) fail("copying the arguments");
    }
    char *start = argv[0], *end = argv[argc - 1] + strlen(argv[argc - 1]);
    static const char shown[] = "hermes-batch-namespace";
    memset(start, 0, (size_t)(end - start));
    memcpy(start, shown, (size_t)(end - start) < sizeof shown - 1 ? (size_t)(end - start) : sizeof shown - 1);
    return copy;
}

/* A session keyring of the namespace's own, so no command possesses the runner's (Kerberos caches, fscrypt
 * keys), and a filter that refuses keyctl, add_key and request_key to every command, so no keyring (the user's
 * included) carries anything between prompts.  The keyring is best effort (a user's key quota, 200 by default,
 * may be used up by as many namespaces): the filter alone keeps every keyring out of reach. */
static void refuse_keyrings(void) {
    syscall(SYS_keyctl, 1 /* KEYCTL_JOIN_SESSION_KEYRING */, NULL);
#ifdef VIEW_ARCH
    static const int calls[] = {SYS_keyctl, SYS_add_key, SYS_request_key};
    struct sock_filter filter[16];
    int n = 0;
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
    filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, VIEW_ARCH, 1, 0);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
#if defined(__x86_64__)
    filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1); /* x32: its own numbers */
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
#endif
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        filter[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)calls[i], 0, 1);
        filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM);
    }
    filter[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    struct sock_fprog program = {(unsigned short)n, filter};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program, 0, 0) < 0) fail("refusing keyrings");
#endif
}

/* The namespace's own IPC objects (a new IPC namespace: they end with it): POSIX message queues listed in a
 * /dev/mqueue of its own, and System V shared memory held to `bytes` in all (the size of its /tmp), where the
 * kernel lets the namespace set it. */
static void own_ipc(unsigned long long bytes) {
    struct stat seen;
    if (stat("/dev/mqueue", &seen) == 0 && S_ISDIR(seen.st_mode)) {
        /* best effort: where it may not be mounted the queues are the namespace's all the same (mq_open is a system
         * call), and the machine's /dev/mqueue, read-only in the view, only lists the machine's by name */
        if (mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0) {
        }
    }
    char text[32];
    long page = sysconf(_SC_PAGESIZE);
    snprintf(text, sizeof text, "%llu", bytes);
    int fd = open("/proc/sys/kernel/shmmax", O_WRONLY | O_CLOEXEC);
    if (fd >= 0 && write(fd, text, strlen(text)) < 0) {
    }
    if (fd >= 0) close(fd);
    snprintf(text, sizeof text, "%llu", bytes / (unsigned long long)(page > 0 ? page : 4096));
    fd = open("/proc/sys/kernel/shmall", O_WRONLY | O_CLOEXEC);
    if (fd >= 0 && write(fd, text, strlen(text)) < 0) {
    }
    if (fd >= 0) close(fd);
}

int main(int argc, char **argv) {
    if (argc > 1 && (strcmp(argv[1], "-O") == 0 || strcmp(argv[1], "-J") == 0)) return container_main(argc, argv);
    if (argc > 1 && strcmp(argv[1], "-G") == 0) return grading_main(argc, argv);
    const char *base = strrchr(argv[0], '/');
    if (strcmp(base ? base + 1 : argv[0], "run-untrusted") == 0) return untrusted_main(argc, argv);
    argv = hide_arguments(argc, argv);
    unsigned long long tmp_bytes = 67108864;
    int user = 0, lower = 0, network = 0;
    uint64_t keep = 0;
    const char *root = NULL;
    int option;
    while ((option = getopt(argc, argv, "+uk:m:i:g:nr:t:h:e:M:P:F:C:")) != -1) {
        rlim_t value;
        if (option == 'u') user = 1;
        else if (option == 'n') network = 1;
        else if (option == 'r') root = optarg;
        else if (option == 'm') {
            max_commands = atoi(optarg);
            if (max_commands < 1 || max_commands > MAX_COMMANDS) max_commands = MAX_COMMANDS;
        } else if (option == 'k') {
            lower = 1;
            keep = strtoull(optarg, NULL, 16);
        } else if (option == 'i') {
            unsigned u, g;
            if (sscanf(optarg, "%u:%u", &u, &g) != 2 || u == 0 || g == 0) return 125;
            as_uid = u;
            as_gid = g;
        } else if (option == 'g') {
            unsigned u, g;
            if (sscanf(optarg, "%u:%u", &u, &g) != 2 || u == 0 || g == 0) return 125;
            grader_uid = u;
            grader_gid = g;
        } else if (option == 't') {
            if (size_option(optarg, &value) < 0) return 125;
            snprintf(tmp_options, sizeof tmp_options, "size=%llu,mode=1777", (unsigned long long)value);
            tmp_bytes = (unsigned long long)value;
        } else if (option == 'h') {
            if (hidden_count == MAX_PATHS || optarg[0] != '/') return 125;
            hidden[hidden_count++] = optarg;
        } else if (option == 'e') {
            if (exposed_count == MAX_PATHS || optarg[0] != '/') return 125;
            char *mode = strrchr(optarg, ':');
            exposed_rw[exposed_count] = mode != NULL && strcmp(mode, ":rw") == 0;
            if (mode != NULL && (exposed_rw[exposed_count] || strcmp(mode, ":ro") == 0)) *mode = 0;
            exposed[exposed_count++] = optarg;
        } else if (strchr("MPFC", option) != NULL) {
            int which = option == 'M' ? 0 : option == 'P' ? 1 : option == 'F' ? 2 : 3;
            if (size_option(optarg, &value) < 0) return 125;
            limits[which].value = value;
            limits[which].set = 1;
        } else return 125;
    }
    if (argc - optind != 3) {
        fprintf(stderr, "usage: %s [-u] [-k CAPS] [-m MAX] [-i UID:GID] [-n] [-r ROOT [-t BYTES] [-h PATH]... "
                        "[-e PATH[:rw]]...] [-M BYTES] [-P COUNT] [-F BYTES] [-C SECONDS] CONTROL CWD SPILL\n", argv[0]);
        return 125;
    }
    if (as_uid != (uid_t)-1 && (user || geteuid() != 0)) return 125; /* -i is root's */
    if (grader_uid != (uid_t)-1 && as_uid == (uid_t)-1) return 125; /* -g goes with -i */
    view_root = root;
    open_control(0, argv[optind]);
    cwd = argv[optind + 1];
    open_control(1, argv[optind + 2]);

    uid_t uid = getuid();
    gid_t gid = getgid();
    int flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | (user ? CLONE_NEWUSER : 0) | (network ? CLONE_NEWNET : 0);
    if (unshare(flags) < 0) fail("unshare");
    if (user) {
        char map[64];
        write_file("/proc/self/setgroups", "deny");
        snprintf(map, sizeof map, "%u %u 1", (unsigned)uid, (unsigned)uid);
        write_file("/proc/self/uid_map", map);
        snprintf(map, sizeof map, "%u %u 1", (unsigned)gid, (unsigned)gid);
        write_file("/proc/self/gid_map", map);
    }

    sigset_t handled, mask;
    sigemptyset(&handled);
    sigaddset(&handled, SIGCHLD);
    sigaddset(&handled, SIGTERM);
    sigaddset(&handled, SIGINT);
    sigprocmask(SIG_BLOCK, &handled, &mask); /* before the fork, so no signal is missed */
    int outer_alive[2]; /* the outer process holds the write end until it ends */
    if (pipe2(outer_alive, O_CLOEXEC) < 0) fail("pipe");
    pid_t first = fork();
    if (first < 0) fail("fork");
    if (first > 0) { /* the outer process: wait for the first one and end as it ended */
        sigprocmask(SIG_SETMASK, &mask, NULL);
        close(outer_alive[0]);
        int status;
        while (waitpid(first, &status, 0) < 0) {
            if (errno != EINTR) return 125;
        }
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) fail("prctl");
    close(outer_alive[1]);
    struct pollfd outer = {outer_alive[0], POLLIN, 0};
    if (poll(&outer, 1, 0) != 0) return 125; /* the outer process died before the death signal was set */
    close(outer_alive[0]);
    if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) fail("making the mounts private");
    if (root != NULL) build_view(root, tmp_options);
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL) < 0) fail("mounting /proc");
    own_ipc(tmp_bytes);
    if (network) loopback_up();
    if (as_uid != (uid_t)-1) {
        lower = 1; /* only what starting its commands as as_uid takes */
        keep = UINT64_C(1) << CAP_SETUID | UINT64_C(1) << CAP_SETGID | UINT64_C(1) << CAP_SETPCAP | UINT64_C(1) << CAP_KILL;
    }
    if (lower) lower_capabilities(keep);
    kept = lower ? keep : ~UINT64_C(0);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("no_new_privs");
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) fail("not dumpable"); /* no command reads its fds through /proc */
    refuse_keyrings();
    return serve(&handled, &mask);
}
