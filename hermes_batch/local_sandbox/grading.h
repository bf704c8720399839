/* A verifier's tests, apart from what the graded agent left behind; part of namespace_init.c.
 *
 *   hermes-batch-namespace-... -G GRADE [-o UID:GID] [-i USER] [-w DIR]... [-x KEY=VALUE]... [-v KEY=VALUE]...
 *       -- ARGV...
 *   GRADE/bin/run-untrusted CMD [ARGS...]        (the same program; its settings are GRADE/untrusted)
 *
 * -G is the tests' supervisor, run as the tests' identity once every process of the session has ended.  It
 * makes the grading folder GRADE, which must not exist (so nothing of the agent's is in it): tests/ (the
 * row's hidden files go there), home/ (the tests' HOME), tmp/ (their TMPDIR), untrusted-tmp/, reward/ (mode
 * 0700, given to -o's user: the only place the reward is read from), bin/run-untrusted (a copy of this
 * program) and untrusted (its settings).  It runs ARGV with exactly the -v environment plus HERMES_TESTS_DIR,
 * HERMES_REWARD_FILE, HERMES_RUN_UNTRUSTED, HOME and TMPDIR, its standard error joined to its standard output.
 * When ARGV ends it ends every process that descends from it (it is their subreaper: a daemon cannot leave),
 * reads GRADE/reward/reward through the folder it opened at the start (so a folder renamed or swapped in
 * meanwhile is never read) and writes one line to its own standard error:
 *
 *   hermes-batch-reward HEX
 *
 * HEX is the hexadecimal of a kind byte and what follows it: "n" (no reward file), "f" and the file's first
 * 257 bytes, or "b" and why the file cannot be read (not a regular file).  It exits with ARGV's status.
 *
 * run-untrusted runs CMD as the agent would run it: as -i USER (a name of /etc/passwd or UID:GID; default
 * the caller's), with the -x environment (default the caller's without the HERMES_ variables), no
 * capabilities it could gain again (an empty bounding set; as root also the securebits that keep root
 * from gaining any), no new privileges, and as many of these as the machine allows:
 *   - namespaces: a PID namespace of its own (so nothing it starts outlives it, and no process of the tests
 *     can be seen or signalled) and a mount namespace in which reward/ is hidden and GRADE is read-only;
 *   - Landlock: it writes only beneath the -w folders (its working folder, HOME, temporary folders) and
 *     /dev, and (Landlock 6) signals no process outside it.
 * Without namespaces it is the subreaper of what CMD starts and, once CMD ends, stops and kills all of it.
 * Where neither namespaces nor Landlock keep it from the tests' files, and the agent's user cannot be told
 * apart from the tests' or is root, it refuses (status 125) rather than run: the tests then fail.
 */
#include <sys/utsname.h>

#ifndef PR_SET_CHILD_SUBREAPER
#define PR_SET_CHILD_SUBREAPER 36
#endif
#ifndef SECBIT_NOROOT
#define SECBIT_NOROOT (1 << 0)
#define SECBIT_NOROOT_LOCKED (1 << 1)
#define SECBIT_NO_SETUID_FIXUP (1 << 2)
#define SECBIT_NO_SETUID_FIXUP_LOCKED (1 << 3)
#define SECBIT_KEEP_CAPS_LOCKED (1 << 5)
#endif
#ifndef PR_SET_SECUREBITS
#define PR_SET_SECUREBITS 28
#endif

#define GRADE_MAX_SETTINGS (1 << 20) /* bytes of GRADE/untrusted */
#define GRADE_MAX_ITEMS 256          /* -w, -x, -v (each) */
#define REWARD_READ 257              /* one byte more than a reward may have: the caller tells a longer file */

/* Landlock (Linux 5.13), called directly: C libraries and headers lag behind it. */
#define LL_CREATE_RULESET 444
#define LL_ADD_RULE 445
#define LL_RESTRICT_SELF 446
#define LL_VERSION (1U << 0)
#define LL_RULE_PATH_BENEATH 1
#define LL_EXECUTE (1ULL << 0)
#define LL_WRITE_FILE (1ULL << 1)
#define LL_READ_FILE (1ULL << 2)
#define LL_READ_DIR (1ULL << 3)
#define LL_REFER (1ULL << 13)
#define LL_TRUNCATE (1ULL << 14)
#define LL_IOCTL_DEV (1ULL << 15)
#define LL_SCOPE_ABSTRACT_UNIX (1ULL << 0)
#define LL_SCOPE_SIGNAL (1ULL << 1)
struct ll_ruleset {
    uint64_t handled_access_fs, handled_access_net, scoped;
};
struct ll_path_beneath {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

struct untrusted {
    uid_t uid;
    gid_t gid;
    int identity;                     /* -i was given */
    const char *hidden[4], *read_only[4], *writable[GRADE_MAX_ITEMS];
    int hidden_count, read_only_count, writable_count;
    const char *grade;                /* GRADE, where run-untrusted was copied to */
    char *env[GRADE_MAX_ITEMS + 1];
    int env_count, env_given;
};

static void grade_say(const char *what, const char *detail) {
    fprintf(stderr, "hermes-batch: %s%s%s%s\n", what, detail ? " (" : "", detail ? detail : "", detail ? ")" : "");
}

/* UID:GID, or a user of /etc/passwd (read here: a static program has no name service). */
static int find_user(const char *text, uid_t *uid, gid_t *gid) {
    unsigned u, g;
    char rest;
    if (sscanf(text, "%u:%u%c", &u, &g, &rest) == 2) {
        *uid = u, *gid = g;
        return 0;
    }
    if (sscanf(text, "%u%c", &u, &rest) == 1) {
        *uid = u, *gid = u;
        return 0;
    }
    FILE *passwd = fopen("/etc/passwd", "re");
    if (passwd == NULL) return -1;
    char line[1024];
    size_t length = strlen(text);
    int found = -1;
    while (found < 0 && fgets(line, sizeof line, passwd)) {
        if (strncmp(line, text, length) != 0 || line[length] != ':') continue;
        char *field = strchr(line + length + 1, ':'); /* past the password */
        if (field && sscanf(field + 1, "%u:%u", &u, &g) == 2) *uid = u, *gid = g, found = 0;
    }
    fclose(passwd);
    return found;
}

static void close_from(int lowest) {
    DIR *fds = opendir("/proc/self/fd");
    if (fds == NULL) {
        for (int fd = lowest; fd < 1024; fd++) close(fd);
        return;
    }
    int own = dirfd(fds);
    struct dirent *entry;
    int found[1024], count = 0;
    while ((entry = readdir(fds)) != NULL && count < 1024) {
        int fd = atoi(entry->d_name);
        if (entry->d_name[0] != '.' && fd >= lowest && fd != own) found[count++] = fd;
    }
    closedir(fds);
    for (int i = 0; i < count; i++) close(found[i]);
}

/* --- ending what descends from this process ------------------------------------------------------------- */

/* The pids whose parent is in `parents` (one pass over /proc); how many were added to `out`. */
static int children_of(const pid_t *parents, int parent_count, pid_t *out, int room) {
    DIR *proc = opendir("/proc");
    if (proc == NULL) return 0;
    struct dirent *entry;
    int count = 0;
    while (count < room && (entry = readdir(proc)) != NULL) {
        pid_t pid = (pid_t)atoi(entry->d_name);
        if (pid <= 0) continue;
        char path[64], text[512];
        snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t got = read(fd, text, sizeof text - 1);
        close(fd);
        if (got <= 0) continue;
        text[got] = 0;
        char *close_paren = strrchr(text, ')');
        if (close_paren == NULL) continue;
        pid_t parent = 0;
        char state = 0;
        if (sscanf(close_paren + 1, " %c %d", &state, &parent) != 2) continue;
        for (int i = 0; i < parent_count; i++) {
            if (parents[i] == parent) {
                out[count++] = pid;
                break;
            }
        }
    }
    closedir(proc);
    return count;
}

/* Every process that descends from this one, which is their subreaper: stopped first, a generation at a time, until
 * a pass finds none running (a stopped process forks no more), then killed and reaped.  As a PID namespace's first
 * process one kill(-1) does it at once.  0 when none is left. */
static int end_descendants(void) {
    if (getpid() == 1) {
        kill(-1, SIGKILL);
    } else {
        enum { ROOM = 65536 };
        static pid_t known[ROOM];
        pid_t self = getpid();
        for (int round = 0; round < 1000; round++) {
            int count = children_of(&self, 1, known, ROOM);
            if (count == 0) break;
            for (int pass = 0; pass < 1000; pass++) { /* stop them, and what they forked meanwhile */
                for (int i = 0; i < count; i++) kill(known[i], SIGSTOP);
                int more = children_of(known, count, known + count, ROOM - count);
                int fresh = 0;
                for (int i = count; i < count + more; i++) {
                    int seen = 0;
                    for (int j = 0; j < count && !seen; j++) seen = known[j] == known[i];
                    if (!seen) known[count + fresh++] = known[i];
                }
                if (fresh == 0 || count + fresh >= ROOM) {
                    count += fresh;
                    break;
                }
                count += fresh;
            }
            for (int i = 0; i < count; i++) kill(known[i], SIGKILL);
            while (waitpid(-1, NULL, WNOHANG) > 0) {
            }
            usleep(1000);
            while (waitpid(-1, NULL, WNOHANG) > 0) {
            }
        }
    }
    for (int tries = 0; tries < 100; tries++) { /* only the dead are left: reaped, never waited on for ever */
        pid_t pid = waitpid(-1, NULL, WNOHANG);
        if (pid < 0 && errno == ECHILD) return 0;
        if (pid <= 0) usleep(10000);
    }
    return -1;
}

/* Wait for `child` (reaping any other), forwarding SIGTERM, SIGINT and SIGHUP to it as SIGKILL; its status. */
static int wait_for(pid_t child, const sigset_t *handled) {
    int signals = signalfd(-1, handled, SFD_CLOEXEC);
    int result = 125;
    for (;;) {
        struct signalfd_siginfo info;
        if (signals >= 0 && read(signals, &info, sizeof info) == sizeof info && info.ssi_signo != SIGCHLD) {
            kill(child, SIGKILL);
        }
        int status;
        pid_t pid;
        int done = 0;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
            if (pid == child) {
                result = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                done = 1;
            }
        }
        if (done || (pid < 0 && errno == ECHILD)) break;
        if (signals < 0) usleep(10000);
    }
    if (signals >= 0) close(signals);
    return result;
}

/* --- run-untrusted -------------------------------------------------------------------------------------- */

/* PATH opened (O_PATH) only if no part of it is a symbolic link: the supervisor gave the -w folders resolved, so a
 * link there now was put by an earlier untrusted command (a working folder swapped for a link to /, to write
 * anywhere); openat2 (Linux 5.6), else at least the last part not a link. */
static int open_without_links(const char *path) {
    struct {
        uint64_t flags, mode, resolve;
    } how = {O_PATH | O_CLOEXEC, 0, 0x04 /* RESOLVE_NO_SYMLINKS */};
    int fd = (int)syscall(437 /* openat2 */, AT_FDCWD, path, &how, sizeof how);
    if (fd >= 0 || (errno != ENOSYS && errno != EPERM)) return fd;
    return open(path, O_PATH | O_NOFOLLOW | O_CLOEXEC);
}

/* Whether the folder open at `dir` is GRADE, holds it, or lies in it (but for its untrusted-tmp/).  Without namespaces
 * nothing but Landlock keeps a root agent's code from the tests' files (root's own, which uid 0 may write without a
 * capability): a -w folder such as a HOME of /, or one the agent left as a link to / (which the supervisor's
 * resolution follows), gets no rule. */
static int touches_grade(int dir, const char *grade) {
    struct stat folder, seen, own;
    char path[PATH_MAX];
    if (fstat(dir, &folder) < 0 || strlen(grade) >= sizeof path - 16) return 1;
    snprintf(path, sizeof path, "%s", grade);
    for (;;) { /* GRADE and its parents */
        if (stat(path, &seen) == 0 && seen.st_dev == folder.st_dev && seen.st_ino == folder.st_ino) return 1;
        char *slash = strrchr(path, '/');
        if (slash == NULL || (slash == path && path[1] == 0)) break;
        slash[slash == path] = 0;
    }
    struct stat grade_seen;
    snprintf(path, sizeof path, "%s/untrusted-tmp", grade);
    if (stat(grade, &grade_seen) < 0) return 1;
    if (stat(path, &own) == 0 && own.st_dev == folder.st_dev && own.st_ino == folder.st_ino) return 0;
    int at = openat(dir, "..", O_PATH | O_DIRECTORY | O_CLOEXEC); /* the folder's parents, up to / */
    for (int depth = 0; at >= 0 && depth < 4096; depth++) {
        if (fstat(at, &seen) < 0) break;
        if (seen.st_dev == grade_seen.st_dev && seen.st_ino == grade_seen.st_ino) {
            close(at);
            return 1;
        }
        int up = openat(at, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
        struct stat above;
        if (up < 0 || fstat(up, &above) < 0 || (above.st_dev == seen.st_dev && above.st_ino == seen.st_ino)) {
            if (up >= 0) close(up);
            break; /* the root */
        }
        close(at);
        at = up;
    }
    if (at >= 0) close(at);
    return 0;
}

static int landlock(const struct untrusted *settings, int namespaces) {
    int abi = (int)syscall(LL_CREATE_RULESET, NULL, 0, LL_VERSION);
    if (abi < 1) return -1;
    uint64_t handled = (UINT64_C(1) << 13) - 1; /* ABI 1: execute up to make_sym */
    if (abi >= 2) handled |= LL_REFER;
    if (abi >= 3) handled |= LL_TRUNCATE;
    if (abi >= 5) handled |= LL_IOCTL_DEV;
    struct ll_ruleset ruleset = {handled, 0, abi >= 6 ? LL_SCOPE_SIGNAL | LL_SCOPE_ABSTRACT_UNIX : 0};
    int fd = (int)syscall(LL_CREATE_RULESET, &ruleset, sizeof ruleset, 0);
    if (fd < 0) return -1;
    struct {
        const char *path;
        uint64_t access;
    } rules[GRADE_MAX_ITEMS + 2];
    int count = 0;
    rules[count++] = (typeof(rules[0])){"/", LL_EXECUTE | LL_READ_FILE | LL_READ_DIR};
    rules[count++] = (typeof(rules[0])){"/dev", LL_READ_FILE | LL_READ_DIR | LL_WRITE_FILE | LL_TRUNCATE | LL_IOCTL_DEV};
    for (int i = 0; i < settings->writable_count; i++) rules[count++] = (typeof(rules[0])){settings->writable[i], handled};
    for (int i = 0; i < count; i++) {
        int dir = open_without_links(rules[i].path);
        if (dir < 0) continue; /* a folder that is not there (or reached through a link) holds nothing to write */
        if (i >= 2 && !namespaces && settings->grade && touches_grade(dir, settings->grade)) {
            close(dir);
            continue;
        }
        struct ll_path_beneath rule = {rules[i].access & handled, dir};
        struct stat seen;
        if (fstat(dir, &seen) == 0 && !S_ISDIR(seen.st_mode)) rule.allowed_access &= LL_EXECUTE | LL_READ_FILE | LL_WRITE_FILE | LL_TRUNCATE | LL_IOCTL_DEV;
        long added = syscall(LL_ADD_RULE, fd, LL_RULE_PATH_BENEATH, &rule, 0);
        close(dir);
        if (added < 0) {
            close(fd);
            return -1;
        }
    }
    long restricted = syscall(LL_RESTRICT_SELF, fd, 0);
    close(fd);
    return restricted < 0 ? -1 : abi;
}

static uid_t getuid_before; /* the tests' user, as run-untrusted started */

/* In the child that becomes CMD: its user, no capabilities to keep or gain, Landlock where there is; -1 and why. */
static int lower_untrusted(const struct untrusted *settings, int namespaces, const char **why) {
    int switching = settings->identity && (getuid() != settings->uid || getgid() != settings->gid);
    int root = switching ? settings->uid == 0 : getuid() == 0 || geteuid() == 0;
    for (int cap = 0; cap <= 63; cap++) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0); /* where it holds CAP_SETPCAP */
    /* Root's securebits keep an exec from giving root its capabilities again.  Without CAP_SETPCAP (a container's root,
     * whose engine dropped it) neither they nor the bounding set can be changed; no_new_privs, set below before the
     * exec, does the same then: an exec under it never gains a capability its caller lacks, and the caller drops all. */
    if (root) prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP |
                                           SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED, 0, 0, 0);
    if (switching) {
        if (setgroups(0, NULL) < 0 && errno != EPERM) return *why = "dropping its groups", -1;
        if (setresgid(settings->gid, settings->gid, settings->gid) < 0) return *why = "taking the agent's group", -1;
        if (setresuid(settings->uid, settings->uid, settings->uid) < 0) return *why = "taking the agent's user", -1;
    }
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) < 0) return *why = "dropping its capabilities", -1;
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) return *why = "dropping its capabilities", -1;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return *why = "no_new_privs", -1;
    int locked = landlock(settings, namespaces) > 0;
    /* Kept from the tests' files by a namespace, by Landlock, or by being another user than the tests and not root. */
    if (!namespaces && !locked && (root || getuid() == getuid_before)) {
        return *why = "no namespaces and no Landlock here, and the agent's user is root or the tests' own", -1;
    }
    return 0;
}

/* GRADE/untrusted: records "K\0VALUE\0" with K one of i (user), h (hidden), r (read-only), w (writable), x (env). */
static int read_settings(const char *path, struct untrusted *settings) {
    static char text[GRADE_MAX_SETTINGS + 1];
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat seen;
    if (fstat(fd, &seen) < 0 || !S_ISREG(seen.st_mode)) return close(fd), -1;
    size_t size = 0;
    ssize_t got;
    while (size < GRADE_MAX_SETTINGS && (got = read(fd, text + size, GRADE_MAX_SETTINGS - size)) > 0) size += (size_t)got;
    close(fd);
    text[size] = 0;
    for (size_t at = 0; at + 2 < size;) {
        char kind = text[at];
        char *value = text + at + 2;
        size_t length = strnlen(value, size - at - 2);
        if (text[at + 1] != 0 || at + 2 + length >= size + 1) return -1;
        if (kind == 'i') {
            if (find_user(value, &settings->uid, &settings->gid) < 0) return -1;
            settings->identity = 1;
        } else if (kind == 'h' && settings->hidden_count < 4) {
            settings->hidden[settings->hidden_count++] = value;
        } else if (kind == 'r' && settings->read_only_count < 4) {
            settings->read_only[settings->read_only_count++] = value;
        } else if (kind == 'w' && settings->writable_count < GRADE_MAX_ITEMS) {
            settings->writable[settings->writable_count++] = value;
        } else if (kind == 'x' && settings->env_count < GRADE_MAX_ITEMS) {
            settings->env[settings->env_count++] = value;
            settings->env_given = 1;
        }
        at += 2 + length + 1;
    }
    settings->env[settings->env_count] = NULL;
    return 0;
}

/* The first process of CMD's namespaces: reward/ hidden, GRADE read-only, a /proc of its own. */
static void untrusted_view(const struct untrusted *settings) {
    if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) return;
    for (int i = 0; i < settings->read_only_count; i++) {
        const char *path = settings->read_only[i];
        if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) == 0) set_attributes(path, AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV);
    }
    for (int i = 0; i < settings->hidden_count; i++) {
        if (mount("tmpfs", settings->hidden[i], "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4096,mode=0") < 0) {
            grade_say("the reward's folder cannot be hidden from the untrusted command", strerror(errno));
            _exit(125);
        }
    }
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL); /* else the tests' pids mean nothing here */
}

/* Whether a user namespace of its own could map this process's user: root's (uid 0 mapped onto itself) needs
 * CAP_SETFCAP (Linux 5.12), which a container's root may lack (Apptainer's with --no-privs --add-caps); once
 * unshared, a namespace whose map cannot be written cannot be left, so it is not tried then (Landlock instead). */
static int may_map_self(void) {
    if (geteuid() != 0) return 1;
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &header, data) < 0) return 0;
    return (data[CAP_SETFCAP / 32].effective >> (CAP_SETFCAP % 32)) & 1;
}

static int untrusted_main(int argc, char **argv) {
    char exe[PATH_MAX], settings_path[PATH_MAX + 16];
    ssize_t length = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (length <= 0) {
        grade_say("run-untrusted cannot find itself", strerror(errno));
        return 125;
    }
    exe[length] = 0;
    char *slash = strrchr(exe, '/');
    if (slash) *slash = 0; /* GRADE/bin */
    slash = strrchr(exe, '/');
    if (slash) *slash = 0; /* GRADE */
    snprintf(settings_path, sizeof settings_path, "%s/untrusted", exe);
    static struct untrusted settings;
    if (read_settings(settings_path, &settings) < 0) {
        grade_say("run-untrusted cannot read its settings", settings_path);
        return 125;
    }
    settings.grade = exe;
    if (argc < 2) {
        fprintf(stderr, "usage: %s CMD [ARGS...]\n", argv[0]);
        return 125;
    }
    if (!settings.env_given) { /* the caller's, without the tests' own variables */
        for (char **entry = environ; *entry && settings.env_count < GRADE_MAX_ITEMS; entry++) {
            if (strncmp(*entry, "HERMES_", 7) != 0) settings.env[settings.env_count++] = *entry;
        }
        settings.env[settings.env_count] = NULL;
    }
    getuid_before = getuid();
    close_from(3);
    int namespaces = unshare(CLONE_NEWNS | CLONE_NEWPID) == 0;
    if (!namespaces && (!settings.identity || settings.uid == getuid()) && may_map_self()) {
        uid_t uid = getuid();
        gid_t gid = getgid();
        if (unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID) == 0) {
            char map[64];
            int fd = open("/proc/self/setgroups", O_WRONLY | O_CLOEXEC);
            if (fd >= 0) {
                if (write(fd, "deny", 4) < 0) {
                }
                close(fd);
            }
            snprintf(map, sizeof map, "%u %u 1", (unsigned)uid, (unsigned)uid);
            int ok = (fd = open("/proc/self/uid_map", O_WRONLY | O_CLOEXEC)) >= 0 && write(fd, map, strlen(map)) > 0;
            if (fd >= 0) close(fd);
            snprintf(map, sizeof map, "%u %u 1", (unsigned)gid, (unsigned)gid);
            ok = ok && (fd = open("/proc/self/gid_map", O_WRONLY | O_CLOEXEC)) >= 0 && write(fd, map, strlen(map)) > 0;
            if (fd >= 0) close(fd);
            if (!ok) {
                grade_say("run-untrusted could not map its user", strerror(errno));
                return 125;
            }
            namespaces = 1;
            settings.identity = 0; /* itself, as the namespace maps it */
        }
    }
    sigset_t handled, mask;
    sigemptyset(&handled);
    sigaddset(&handled, SIGCHLD);
    sigaddset(&handled, SIGTERM);
    sigaddset(&handled, SIGINT);
    sigaddset(&handled, SIGHUP);
    sigprocmask(SIG_BLOCK, &handled, &mask);
    if (!namespaces && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) {
        grade_say("run-untrusted cannot hold what the command starts", strerror(errno));
        return 125;
    }
    pid_t first = fork();
    if (first < 0) {
        grade_say("run-untrusted cannot fork", strerror(errno));
        return 125;
    }
    if (first == 0) {
        if (namespaces) { /* the namespace's first process: it holds CMD's processes, which end with it */
            prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
            untrusted_view(&settings);
            pid_t command = fork();
            if (command < 0) _exit(125);
            if (command > 0) {
                int status = wait_for(command, &handled);
                _exit(status); /* the kernel kills what is left */
            }
        }
        sigprocmask(SIG_SETMASK, &mask, NULL);
        const char *why = NULL;
        if (lower_untrusted(&settings, namespaces, &why) < 0) {
            grade_say("run-untrusted refuses to run the command", why);
            _exit(125);
        }
        environ = settings.env;
        execvp(argv[1], argv + 1);
        fprintf(stderr, "run-untrusted: %s: %s\n", argv[1], strerror(errno));
        _exit(127);
    }
    int status = wait_for(first, &handled);
    if (!namespaces && end_descendants() < 0) {
        grade_say("run-untrusted could not end what the command started", NULL);
        return 125;
    }
    return status;
}

/* --- the tests' supervisor (-G) ------------------------------------------------------------------------- */

struct grading {
    const char *grade;             /* the folder to make */
    uid_t reward_uid;              /* -o: reward/'s owner (root only) */
    gid_t reward_gid;
    int reward_owner;
    const char *user;              /* -i, for run-untrusted */
    const char *writable[GRADE_MAX_ITEMS];
    int writable_count;
    char *const *agent_env;        /* -x, for run-untrusted (NULL: the tests' environment at the call) */
    int agent_env_count;
    char *const *tests_env;        /* -v */
    int tests_env_count;
};

static int copy_self(int dir, const char *name) {
    char buffer[65536];
    int in = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    if (in < 0) return -1;
    int out = openat(dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0755);
    if (out < 0) return close(in), -1;
    ssize_t got;
    int result = 0;
    while ((got = read(in, buffer, sizeof buffer)) > 0) {
        if (write(out, buffer, (size_t)got) != got) {
            result = -1;
            break;
        }
    }
    if (got < 0) result = -1;
    close(in);
    if (fchmod(out, 0755) < 0) result = -1;
    close(out);
    return result;
}

static int record(int fd, char kind, const char *value) {
    char head[2] = {kind, 0};
    size_t length = strlen(value) + 1;
    return write(fd, head, 2) == 2 && write(fd, value, length) == (ssize_t)length ? 0 : -1;
}

/* "hermes-batch-reward HEX" of what GRADE/reward/reward holds, read through `reward_dir`, to `out`. */
static void report_reward(int reward_dir, int out) {
    unsigned char blob[REWARD_READ + 1 + 128];
    size_t size = 0;
    int fd = openat(reward_dir, "reward", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    struct stat seen;
    if (fd < 0 && errno == ENOENT) {
        blob[size++] = 'n';
    } else if (fd < 0 || fstat(fd, &seen) < 0 || !S_ISREG(seen.st_mode)) {
        const char *why = fd >= 0 ? "not a regular file" : errno == ELOOP ? "a symbolic link" : strerror(errno);
        size = (size_t)snprintf((char *)blob, sizeof blob, "b%s", why);
    } else {
        blob[size++] = 'f';
        ssize_t got;
        while (size < REWARD_READ + 1 && (got = read(fd, blob + size, REWARD_READ + 1 - size)) > 0) size += (size_t)got;
    }
    if (fd >= 0) close(fd);
    char line[2 * sizeof blob + 32];
    int n = snprintf(line, sizeof line, "hermes-batch-reward ");
    for (size_t i = 0; i < size; i++) n += snprintf(line + n, sizeof line - n, "%02x", blob[i]);
    line[n++] = '\n';
    while (write(out, line, (size_t)n) < 0 && errno == EINTR) {
    }
}

/* Make GRADE, run ARGV in it as the tests, end what it left, report the reward to `out`; ARGV's status. */
static int supervise(const struct grading *g, char **command, int out) {
    char path[PATH_MAX];
    if (strlen(g->grade) > PATH_MAX - 64 || g->grade[0] != '/') {
        grade_say("the grading folder must be an absolute path", g->grade);
        return 125;
    }
    umask(022);
    if (mkdir(g->grade, 0755) < 0) {
        grade_say("cannot make the grading folder", strerror(errno));
        return 125;
    }
    int grade = open(g->grade, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (grade < 0 || mkdirat(grade, "tests", 0755) < 0 || mkdirat(grade, "home", 0700) < 0 ||
        mkdirat(grade, "tmp", 0755) < 0 || mkdirat(grade, "untrusted-tmp", 0777) < 0 || mkdirat(grade, "reward", 0700) < 0 ||
        mkdirat(grade, "bin", 0755) < 0) {
        grade_say("cannot make the grading folder's parts", strerror(errno));
        return 125;
    }
    int untrusted_tmp = openat(grade, "untrusted-tmp", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (untrusted_tmp < 0 || fchmod(untrusted_tmp, 01777) < 0) {
        grade_say("cannot make the untrusted command's temporary folder", strerror(errno));
        return 125;
    }
    close(untrusted_tmp);
    int reward = openat(grade, "reward", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (reward < 0 || (g->reward_owner && fchown(reward, g->reward_uid, g->reward_gid) < 0)) {
        grade_say("cannot give the reward's folder its owner", strerror(errno));
        return 125;
    }
    int bin = openat(grade, "bin", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (bin < 0 || copy_self(bin, "run-untrusted") < 0) {
        grade_say("cannot place run-untrusted", strerror(errno));
        return 125;
    }
    close(bin);
    int settings = openat(grade, "untrusted", O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    int ok = settings >= 0;
    if (ok && g->user) ok = record(settings, 'i', g->user) == 0;
    snprintf(path, sizeof path, "%s/reward", g->grade);
    if (ok) ok = record(settings, 'h', path) == 0;
    if (ok) ok = record(settings, 'r', g->grade) == 0;
    snprintf(path, sizeof path, "%s/untrusted-tmp", g->grade);
    if (ok) ok = record(settings, 'w', path) == 0;
    for (int i = 0; ok && i < g->writable_count; i++) { /* resolved now, while nothing of the agent's runs */
        char real[PATH_MAX];
        ok = record(settings, 'w', realpath(g->writable[i], real) ? real : g->writable[i]) == 0;
    }
    for (int i = 0; ok && i < g->agent_env_count; i++) ok = record(settings, 'x', g->agent_env[i]) == 0;
    if (settings >= 0) close(settings);
    if (!ok) {
        grade_say("cannot write run-untrusted's settings", strerror(errno));
        return 125;
    }
    static char *env[GRADE_MAX_ITEMS + 8];
    static char own[5][PATH_MAX + 32];
    int count = 0;
    snprintf(own[0], sizeof own[0], "HERMES_TESTS_DIR=%s/tests", g->grade);
    snprintf(own[1], sizeof own[1], "HERMES_REWARD_FILE=%s/reward/reward", g->grade);
    snprintf(own[2], sizeof own[2], "HERMES_RUN_UNTRUSTED=%s/bin/run-untrusted", g->grade);
    snprintf(own[3], sizeof own[3], "HOME=%s/home", g->grade);
    snprintf(own[4], sizeof own[4], "TMPDIR=%s/tmp", g->grade);
    for (int i = 0; i < 5; i++) env[count++] = own[i];
    for (int i = 0; i < g->tests_env_count && count < GRADE_MAX_ITEMS + 5; i++) {
        const char *entry = g->tests_env[i];
        if (strncmp(entry, "HERMES_TESTS_DIR=", 17) && strncmp(entry, "HERMES_REWARD_FILE=", 19) &&
            strncmp(entry, "HERMES_RUN_UNTRUSTED=", 21) && strncmp(entry, "HOME=", 5) && strncmp(entry, "TMPDIR=", 7)) {
            env[count++] = (char *)entry;
        }
    }
    env[count] = NULL;

    sigset_t handled, mask;
    sigemptyset(&handled);
    sigaddset(&handled, SIGCHLD);
    sigaddset(&handled, SIGTERM);
    sigaddset(&handled, SIGINT);
    sigaddset(&handled, SIGHUP);
    sigprocmask(SIG_BLOCK, &handled, &mask);
    if (getpid() != 1) prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    pid_t tests = fork();
    if (tests < 0) {
        grade_say("cannot start the tests", strerror(errno));
        return 125;
    }
    if (tests == 0) {
        sigprocmask(SIG_SETMASK, &mask, NULL);
        if (chdir(g->grade) < 0) _exit(125); /* the script enters the working folder itself */
        execve(command[0], command, env);
        fprintf(stderr, "hermes-batch: the tests cannot start: %s: %s\n", command[0], strerror(errno));
        _exit(127);
    }
    int status = wait_for(tests, &handled);
    if (end_descendants() < 0) { /* what could still write the reward was not ended: no reward is read */
        const char *line = "hermes-batch-reward 62"; /* "b" */
        char text[256];
        int n = snprintf(text, sizeof text, "%s", line);
        const char *why = "processes of the tests could not be ended";
        for (const char *c = why; *c && n < (int)sizeof text - 3; c++) n += snprintf(text + n, sizeof text - n, "%02x", (unsigned char)*c);
        text[n++] = '\n';
        if (write(out, text, (size_t)n) < 0) {
        }
        return status;
    }
    report_reward(reward, out);
    return status;
}

/* -G GRADE [-o UID:GID] [-i USER] [-w DIR]... [-x KEY=VALUE]... [-v KEY=VALUE]... -- ARGV... */
static int grading_main(int argc, char **argv) {
    static struct grading g;
    static char *agent_env[GRADE_MAX_ITEMS], *tests_env[GRADE_MAX_ITEMS];
    g.agent_env = agent_env;
    g.tests_env = tests_env;
    int option;
    while ((option = getopt(argc, argv, "+G:o:i:w:x:v:")) != -1) {
        if (option == 'G') g.grade = optarg;
        else if (option == 'o') {
            if (find_user(optarg, &g.reward_uid, &g.reward_gid) < 0) return 125;
            g.reward_owner = 1;
        } else if (option == 'i') g.user = optarg;
        else if (option == 'w' && g.writable_count < GRADE_MAX_ITEMS) g.writable[g.writable_count++] = optarg;
        else if (option == 'x' && g.agent_env_count < GRADE_MAX_ITEMS) agent_env[g.agent_env_count++] = optarg;
        else if (option == 'v' && g.tests_env_count < GRADE_MAX_ITEMS) tests_env[g.tests_env_count++] = optarg;
        else return 125;
    }
    if (g.grade == NULL || optind >= argc) {
        fprintf(stderr, "usage: %s -G GRADE [-o UID:GID] [-i USER] [-w DIR]... [-x K=V]... [-v K=V]... -- ARGV...\n", argv[0]);
        return 125;
    }
    int out = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3); /* the report's; the tests' errors join their output */
    if (out < 0 || dup2(STDOUT_FILENO, STDERR_FILENO) < 0) return 125;
    int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null >= 0) dup2(null, STDIN_FILENO);
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) return 125; /* no process of the tests reads its fds */
    return supervise(&g, argv + optind, out);
}

/* --- a local sandbox's tests: the request gID ------------------------------------------------------------- */

/* SPILL/ID<suffix>, read whole (at most `limit` bytes) and removed; NULL on failure. */
static char *take_control_file(const char *id, const char *suffix, size_t limit, size_t *size) {
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s%s", names[1], id, suffix);
    int fd = openat(dirfds[1], path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    struct stat seen;
    if (fd < 0 || fstat(fd, &seen) < 0 || !S_ISREG(seen.st_mode) || (size_t)seen.st_size > limit) {
        if (fd >= 0) close(fd);
        return NULL;
    }
    char *text = malloc((size_t)seen.st_size + 1);
    size_t got_total = 0;
    ssize_t got = 1;
    while (text && got_total < (size_t)seen.st_size && got > 0) {
        got = read(fd, text + got_total, (size_t)seen.st_size - got_total);
        if (got < 0 && errno == EINTR) got = 1;
        else if (got > 0) got_total += (size_t)got;
    }
    close(fd);
    unlinkat(dirfds[1], path, 0);
    if (text == NULL) return NULL;
    text[got_total] = 0;
    *size = got_total;
    return text;
}

static int write_map(pid_t pid, const char *file, const char *text) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, file);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t done = write(fd, text, strlen(text));
    close(fd);
    return done == (ssize_t)strlen(text) ? 0 : -1;
}

/* The process that runs a request gID (the command's pid the runner sees): the tests, SPILL/ID.sh with the
 * environment SPILL/ID.env (KEY=VALUE, each ended by a NUL), output to the FIFO SPILL/ID.out, in a user namespace
 * of their own (as root: its root is the -g user and -i's user is mapped, so the tests may change the agent's files
 * whatever their modes, and run-untrusted becomes the agent; else its root is the invoking user) and new mount, PID
 * and IPC namespaces, with a /tmp, /dev/shm and /proc of their own.  It answers "r ID HEX" (the supervisor's report)
 * before it ends with the tests' status. */
static void grade_child(const char *id, const sigset_t *mask) {
    sigprocmask(SIG_SETMASK, mask, NULL);
    setpgid(0, 0);
    char path[PATH_MAX];
    int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    snprintf(path, sizeof path, "%s/%s.out", names[1], id);
    int out = openat(dirfds[1], path, O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
    if (null < 0 || out < 0) _exit(126);
    unlinkat(dirfds[1], path, 0);
    size_t script_size = 0, env_size = 0;
    char *script = take_control_file(id, ".sh", 64 << 20, &script_size);
    char *env_text = take_control_file(id, ".env", 1 << 20, &env_size);
    if (script == NULL || env_text == NULL) {
        dprintf(out, "hermes-batch: the tests' files could not be read\n");
        _exit(126);
    }
    static char *tests_env[GRADE_MAX_ITEMS];
    int tests_env_count = 0;
    for (size_t at = 0; at < env_size && tests_env_count < GRADE_MAX_ITEMS; at += strlen(env_text + at) + 1) {
        if (env_text[at]) tests_env[tests_env_count++] = env_text + at;
    }
    int up[2], down[2], report[2];
    if (pipe2(up, O_CLOEXEC) < 0 || pipe2(down, O_CLOEXEC) < 0 || pipe2(report, O_CLOEXEC) < 0) _exit(126);
    if (as_uid != (uid_t)-1 && (grader_uid == (uid_t)-1 || setgroups(0, NULL) < 0)) {
        dprintf(out, "hermes-batch: the tests have no user of their own (-g)\n");
        _exit(126);
    }
    pid_t namespaces = fork();
    if (namespaces < 0) _exit(126);
    if (namespaces == 0) {
        close(up[0]);
        close(down[1]);
        close(report[0]);
        dup2(null, STDIN_FILENO); /* the runner's answers are not the tests' to write */
        dup2(out, STDOUT_FILENO);
        dup2(out, STDERR_FILENO);
        prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
        prctl(PR_SET_DUMPABLE, 1, 0, 0, 0); /* so that its parent may write its maps */
        char go = 0;
        if (unshare(CLONE_NEWUSER) < 0 || write(up[1], "u", 1) != 1 || read(down[0], &go, 1) != 1 || go != 'm') {
            fprintf(stderr, "hermes-batch: the tests' user namespace could not be made: %s\n", strerror(errno));
            _exit(125);
        }
        prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
        if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0 || unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC) < 0) {
            fprintf(stderr, "hermes-batch: the tests' namespaces could not be made: %s\n", strerror(errno));
            _exit(125);
        }
        sigset_t handled, previous;
        sigemptyset(&handled);
        sigaddset(&handled, SIGCHLD);
        sigprocmask(SIG_BLOCK, &handled, &previous);
        pid_t first = fork();
        if (first < 0) _exit(125);
        if (first == 0) {
            sigprocmask(SIG_SETMASK, &previous, NULL);
            prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
            if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) {
                fprintf(stderr, "hermes-batch: the tests' view could not be made: %s\n", strerror(errno));
                _exit(125);
            }
            /* their own /tmp and /dev/shm, with the prompt's folder and the exposed paths that lie in them put back */
            const char *folder = view_root ? view_root : cwd;
            int folder_tree = clone_tree(folder);
            int kept_trees[MAX_PATHS];
            for (int i = 0; i < exposed_count; i++) {
                kept_trees[i] = strncmp(exposed[i], "/tmp/", 5) == 0 || strncmp(exposed[i], "/dev/shm/", 9) == 0
                                    ? clone_tree(exposed[i]) : -1;
            }
            struct stat seen;
            if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_options) < 0 ||
                (stat("/dev/shm", &seen) == 0 && S_ISDIR(seen.st_mode) &&
                 mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, tmp_options) < 0) ||
                mount("proc", "/proc", "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, NULL) < 0) {
                fprintf(stderr, "hermes-batch: the tests' view could not be made: %s\n", strerror(errno));
                _exit(125);
            }
            for (int i = 0; i < exposed_count; i++) {
                if (kept_trees[i] >= 0) attach(kept_trees[i], exposed[i]);
            }
            if (stat(folder, &seen) < 0) attach(folder_tree, folder);
            else close(folder_tree);
            static char user[32];
            static struct grading g;
            g.grade = "/tmp/hermes-grade";
            if (as_uid != (uid_t)-1) {
                snprintf(user, sizeof user, "%u:%u", (unsigned)as_uid, (unsigned)as_gid);
                g.user = user;
            }
            g.writable[g.writable_count++] = view_root ? view_root : cwd;
            g.writable[g.writable_count++] = "/tmp";
            g.writable[g.writable_count++] = "/dev/shm";
            int agent_count = 0;
            while (environ[agent_count] && agent_count < GRADE_MAX_ITEMS) agent_count++;
            g.agent_env = environ; /* the first process's: the one the agent's commands had */
            g.agent_env_count = agent_count;
            g.tests_env = tests_env;
            g.tests_env_count = tests_env_count;
            char *argv[] = {"/bin/sh", "-c", script, NULL};
            _exit(supervise(&g, argv, report[1]));
        }
        close(report[1]);
        int status;
        while (waitpid(first, &status, 0) < 0) {
            if (errno != EINTR) _exit(125);
        }
        _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    }
    close(up[1]);
    close(down[0]);
    close(report[1]);
    close(out);
    char ready = 0, map[128];
    int mapped = read(up[0], &ready, 1) == 1;
    if (mapped && as_uid != (uid_t)-1) {
        snprintf(map, sizeof map, "0 %u 1\n%u %u 1\n", (unsigned)grader_uid, (unsigned)as_uid, (unsigned)as_uid);
        mapped = write_map(namespaces, "uid_map", map) == 0;
        snprintf(map, sizeof map, "0 %u 1\n%u %u 1\n", (unsigned)grader_gid, (unsigned)as_gid, (unsigned)as_gid);
        mapped = mapped && write_map(namespaces, "gid_map", map) == 0;
    } else if (mapped) {
        snprintf(map, sizeof map, "0 %u 1\n", (unsigned)getuid());
        mapped = write_map(namespaces, "setgroups", "deny") == 0 && write_map(namespaces, "uid_map", map) == 0;
        snprintf(map, sizeof map, "0 %u 1\n", (unsigned)getgid());
        mapped = mapped && write_map(namespaces, "gid_map", map) == 0;
    }
    if (mapped && write(down[1], "m", 1) != 1) mapped = 0;
    close(down[1]);
    char line[4096];
    size_t used = 0;
    ssize_t got;
    while (used < sizeof line - 1 && (got = read(report[0], line + used, sizeof line - 1 - used)) != 0) {
        if (got < 0) {
            if (errno == EINTR) continue;
            break;
        }
        used += (size_t)got;
    }
    line[used] = 0;
    int status;
    while (waitpid(namespaces, &status, 0) < 0) {
        if (errno != EINTR) _exit(125);
    }
    const char *prefix = "hermes-batch-reward ";
    char *hex = strncmp(line, prefix, strlen(prefix)) == 0 ? line + strlen(prefix) : NULL;
    if (hex != NULL) {
        hex[strcspn(hex, "\n")] = 0;
        char answer_line[sizeof line + MAX_ID + 8];
        int n = snprintf(answer_line, sizeof answer_line, "r %s %s\n", id, hex);
        while (write(STDOUT_FILENO, answer_line, (size_t)n) < 0 && errno == EINTR) {
        }
    }
    if (!mapped) _exit(125);
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

static void start_grading(const char *id, const sigset_t *mask) {
    size_t length = strlen(id);
    if (length == 0 || length > MAX_ID || strchr(id, '/') || strchr(id, ' ')) return;
    int slot = 0;
    while (slot < max_commands && commands[slot].pid != 0) slot++;
    if (slot == max_commands) {
        refuse(1, id, "too many commands at once");
        return;
    }
    pid_t pid = fork();
    if (pid < 0) {
        refuse(1, id, strerror(errno));
        return;
    }
    if (pid == 0) grade_child(id, mask);
    setpgid(pid, pid);
    commands[slot].pid = pid;
    memcpy(commands[slot].id, id, length + 1);
    answer('p', id, pid);
}
