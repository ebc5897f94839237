/**
 * What the extension shows, computed from the server's models: no JupyterLab imports here,
 * so the unit tests (vitest) run it as plain TypeScript.
 */

export interface Warning {
  message: string;
  hibernate_at: number | null;
}

export interface ResumeProgress {
  phase: 'waiting_for_slice' | 'starting' | 'restoring';
  restored_mib?: number;
  total_mib?: number;
  /** While waiting: its place in the queue for a GPU slice, of how many, and a guess in seconds. */
  position?: number | null;
  waiting?: number;
  estimate_s?: number | null;
}

/** " (2 of 3 in the queue, about 4 min)" while a resume waits in line, else "". */
export function queuePlace(resume: ResumeProgress): string {
  if (!resume.position) {
    return '';
  }
  let text = `${resume.position} of ${resume.waiting ?? resume.position} in the queue`;
  const estimate = resume.estimate_s;
  if (estimate !== null && estimate !== undefined) {
    text += estimate < 120 ? `, about ${Math.round(estimate)} s` : `, about ${Math.round(estimate / 60)} min`;
  }
  return ` (${text})`;
}

export interface ElasticKernel {
  id: string;
  name: string | null;
  profile: string | null;
  state: string;
  execution_state: string | null;
  owner: string;
  slice: { devices?: string[]; fraction?: number; memory_mib?: number | null } | null;
  activity: {
    gpu_utilization: number | null;
    gpu_memory_mib: number | null;
    idle_seconds?: number;
    warning?: Warning | null;
  };
  resume?: ResumeProgress | null;
  /** While hibernating: the checkpoint's bytes written so far, and the writer's estimate. */
  hibernate?: { written_mib?: number; expected_mib?: number } | null;
  last_error?: string;
  checkpoint?: { bytes?: number } | null;
  /** Why it is in its state: "policy" for the admin's idle culling, "api", "resize", ... */
  state_reason?: string;
}

export interface RestoreReport {
  restored?: string[];
  recomputed?: { name: string; cells?: number[] }[] | string[];
  not_restored?: { name: string; reason?: string; stage?: string; not_recomputed?: string }[];
  differs?: Record<string, string>;
  refused?: string | null;
}

/** "3.2 GiB" / "512 MiB". */
export function formatMib(mib: number | null | undefined): string {
  if (mib === null || mib === undefined) {
    return '';
  }
  return mib >= 1024 ? `${(mib / 1024).toFixed(1)} GiB` : `${Math.round(mib)} MiB`;
}

/** "80 B", "1.5 KiB", "300 MiB", "10 GiB": three significant digits at most, never an exponent. */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined) {
    return '';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  if (unit === 0) {
    return `${Math.round(value)} B`;
  }
  const digits = value < 10 ? 2 : value < 100 ? 1 : 0;
  return `${parseFloat(value.toFixed(digits))} ${units[unit]}`;
}

/**
 * GPU time released, as a person reads it: "none yet", "under 1 GPU-minute", "12 GPU-minutes",
 * "3.4 GPU-hours" (a GPU-hour is one whole GPU held, or not held, for an hour).
 */
export function formatGpuHours(hours: number): string {
  if (!(hours > 0)) {
    return 'none yet';
  }
  const minutes = hours * 60;
  if (minutes < 1) {
    return 'under 1 GPU-minute';
  }
  if (minutes < 60) {
    const whole = Math.round(minutes);
    return `${whole} GPU-minute${whole === 1 ? '' : 's'}`;
  }
  return `${parseFloat(hours.toFixed(1))} GPU-hours`;
}

/** What the notebook toolbar says beside the kernel's circle; '' while the kernel runs. */
export function toolbarText(kernel: ElasticKernel | null | undefined): string {
  if (!kernel || !kernel.profile) {
    return '';
  }
  switch (kernel.state) {
    case 'hibernated':
      return 'Hibernated';
    case 'hibernating':
      return 'Hibernating…';
    case 'resuming':
      return kernel.resume?.phase === 'waiting_for_slice' ? 'Resuming: waiting for a GPU…' : 'Resuming…';
  }
  return '';
}

/** The notebook a kernel belongs to (its session's path, last part), else the id's first 8. */
export function kernelLabel(kernelId: string, notebooks: Map<string, string>): string {
  const path = notebooks.get(kernelId);
  if (path) {
    return path.split('/').pop() || path;
  }
  return kernelId.slice(0, 8);
}

/** A hibernation's progress: "hibernating: 120 MiB of about 400 MiB written". */
export function hibernateText(progress: ElasticKernel['hibernate']): string {
  if (!progress || progress.written_mib === undefined) {
    return 'hibernating';
  }
  const expected = progress.expected_mib ? ` of about ${formatMib(progress.expected_mib)}` : '';
  return `hibernating: ${formatMib(progress.written_mib)}${expected} written`;
}

/** The phase of a resume, in words. */
export function resumeText(resume: ResumeProgress | null | undefined): string {
  if (!resume) {
    return 'resuming';
  }
  switch (resume.phase) {
    case 'waiting_for_slice':
      return `resuming: waiting for a free GPU slice${queuePlace(resume)}`;
    case 'starting':
      return 'resuming: starting the kernel';
    case 'restoring':
      return `resuming: restoring ${Math.round(resume.restored_mib ?? 0)} of ${Math.round(
        resume.total_mib ?? 0
      )} MiB`;
  }
  return 'resuming';
}

/**
 * busy / idle / idle for N min / hibernating / hibernated / resuming (with its phase): the one
 * state of the kernel. `live` is JupyterLab's own status of the kernel (busy, idle, starting...),
 * newer than the last poll while the kernel runs.
 */
export function stateText(kernel: ElasticKernel, live?: string): string {
  switch (kernel.state) {
    case 'running': {
      const now = live && live !== 'unknown' ? live : kernel.execution_state;
      if (now === 'busy') {
        return 'busy';
      }
      if (now && now !== 'idle') {
        return now; // starting, restarting, dead...
      }
      const idle = kernel.activity.idle_seconds ?? 0;
      return idle >= 60 ? `idle for ${Math.floor(idle / 60)} min` : 'idle';
    }
    case 'resuming':
      return resumeText(kernel.resume);
    case 'hibernating':
      return hibernateText(kernel.hibernate);
    default:
      return kernel.state;
  }
}

/** What the status item shows besides the state (the extension's settings; all on by default). */
export interface StatusOptions {
  size: boolean;
  gpuUse: boolean;
  idleTime: boolean;
}

export const STATUS_DEFAULTS: StatusOptions = { size: true, gpuUse: true, idleTime: true };

/** The status bar's text, or null when the kernel has no GPU size (the item hides). */
export function statusText(
  kernel: ElasticKernel | null | undefined,
  sizeLabel?: string,
  live?: string,
  options: StatusOptions = STATUS_DEFAULTS
): string | null {
  if (!kernel || !kernel.profile) {
    return null;
  }
  const parts = options.size ? [`GPU ${sizeLabel ?? kernel.profile}`] : [];
  if (kernel.state === 'running' && options.gpuUse) {
    const { gpu_utilization: util, gpu_memory_mib: mem } = kernel.activity;
    if (util !== null && util !== undefined) {
      parts.push(`${Math.round(util)}%`);
    }
    if (mem !== null && mem !== undefined) {
      parts.push(formatMib(mem));
    }
  }
  const state = stateText(kernel, live);
  parts.push(options.idleTime || !state.startsWith('idle for ') ? state : 'idle');
  return parts.join(' · ');
}

/** Seconds left before the announced hibernation (never negative). */
export function secondsLeft(warning: Warning, nowSeconds: number): number {
  if (warning.hibernate_at === null) {
    return 0;
  }
  return Math.max(0, Math.round(warning.hibernate_at - nowSeconds));
}

/** The notification's text for an idle warning. */
export function warningText(kernel: ElasticKernel, nowSeconds: number, notebook?: string): string {
  const warning = kernel.activity.warning;
  if (!warning) {
    return '';
  }
  const where = notebook ? `${notebook}: ` : '';
  const left = secondsLeft(warning, nowSeconds);
  return `${where}idle kernel (GPU ${kernel.profile}) will be hibernated in ${left} s; its variables are saved first.`;
}

/** The restore report as a short note a person reads. */
export function reportText(report: RestoreReport | null | undefined): string {
  if (!report) {
    return 'Kernel resumed.';
  }
  if (report.refused) {
    return `Kernel resumed empty: the checkpoint was not loaded (${report.refused}).`;
  }
  const restored = report.restored ?? [];
  const lines = [`Kernel resumed: ${restored.length} variable(s) restored.`];
  if (restored.length) {
    lines.push(`Restored: ${restored.join(', ')}.`);
  }
  const recomputed = report.recomputed ?? [];
  if (recomputed.length) {
    const names = recomputed.map(item => (typeof item === 'string' ? item : item.name));
    lines.push(`Recomputed by re-running cells: ${names.join(', ')}.`);
  }
  for (const item of report.not_restored ?? []) {
    const why = item.reason ?? 'unknown reason';
    const more = item.not_recomputed ? ` (not recomputed: ${item.not_recomputed})` : '';
    lines.push(`Not restored: ${item.name}: ${why}${more}.`);
  }
  for (const [name, why] of Object.entries(report.differs ?? {})) {
    lines.push(`Restored with differences: ${name}: ${why}.`);
  }
  return lines.join('\n');
}

/** One line for the notification (JupyterLab cuts longer ones); the full text is a click away. */
export function reportSummary(report: RestoreReport | null | undefined, resizedTo?: string): string {
  const done = resizedTo ? `Kernel resized to GPU ${resizedTo}` : 'Kernel resumed';
  if (!report) {
    return done + '.';
  }
  if (report.refused) {
    return `${done}, empty: none of its variables came back (its checkpoint could not be loaded). Run your cells again to rebuild them.`;
  }
  const missing = (report.not_restored ?? []).map(item => item.name);
  const recomputed = (report.recomputed ?? []).length;
  let text = `${done}: ${(report.restored ?? []).length} variable(s) restored`;
  if (recomputed) {
    text += `, ${recomputed} recomputed`;
  }
  if (missing.length) {
    text += `; not restored: ${missing.join(', ')}`;
  }
  return text + '.';
}

/** How a resume's notification looks: a good one closes by itself; one that lost variables is a
 * warning, and one that lost them all an error, both staying until the user has read them. */
export function reportSeverity(report: RestoreReport | null | undefined): 'success' | 'warning' | 'error' {
  if (report?.refused) {
    return 'error';
  }
  return (report?.not_restored ?? []).length ? 'warning' : 'success';
}

/** Which transitions of one kernel the extension reacts to, between two polls. */
export interface Changes {
  warned: boolean;
  warningCleared: boolean;
  resumed: boolean;
  /** Hibernated by the idle policy (not by the user, an admin or a resize). */
  culled: boolean;
}

export function changes(before: ElasticKernel | undefined, after: ElasticKernel | undefined): Changes {
  const had = !!before?.activity.warning;
  const has = !!after?.activity.warning;
  const wasAsleep = !!before && ['hibernated', 'resuming', 'hibernating'].includes(before.state);
  return {
    warned: has && !had,
    warningCleared: had && !has,
    resumed: wasAsleep && after?.state === 'running',
    culled: !!before && before.state !== 'hibernated' && after?.state === 'hibernated' && after.state_reason === 'policy'
  };
}

/** What the notebook's user is told when the idle policy hibernated its kernel. */
export function culledText(where: string | undefined): string {
  return `${where ? where + ': ' : ''}the kernel was idle, so it was hibernated to free its GPU; its variables are saved. Run a cell to bring it back.`;
}

export type Fetcher = (
  path: string,
  init?: { method?: string; body?: string }
) => Promise<{ status: number; json(): Promise<unknown> }>;

/**
 * One shared poll of `GET /api/elastic/kernels` for every open notebook and the GPUs panel:
 * the whole extension costs the server one request every `intervalMs`. A 404 (a server
 * without the extension's server part) stops it for good and reports `unavailable`.
 */
export class KernelPoller {
  kernels = new Map<string, ElasticKernel>();
  available: boolean | null = null;
  /** False while the server does not answer (stopped, restarting, a proxy's 5xx): what is shown
   * is then from `lastAnswer` (ms since the epoch), and nothing may be acted on. */
  reachable = true;
  lastAnswer: number | null = null;
  private timer: ReturnType<typeof setTimeout> | null = null;
  private listeners: ((poller: KernelPoller, previous: Map<string, ElasticKernel>) => void)[] = [];

  constructor(
    private fetcher: Fetcher,
    public intervalMs = 3000,
    public fastIntervalMs = 1000
  ) {}

  /** Faster only while a kernel is hibernating or resuming (seconds), so its phases show. */
  nextDelay(): number {
    for (const kernel of this.kernels.values()) {
      if (kernel.state === 'resuming' || kernel.state === 'hibernating') {
        return this.fastIntervalMs;
      }
    }
    return this.intervalMs;
  }

  onUpdate(listener: (poller: KernelPoller, previous: Map<string, ElasticKernel>) => void): void {
    this.listeners.push(listener);
  }

  async poll(): Promise<void> {
    let reply;
    try {
      reply = await this.fetcher('api/elastic/kernels');
    } catch {
      this.unreachable(); // stopped or restarting: keep what we showed, say so, try again later
      return;
    }
    if (reply.status >= 500) {
      this.unreachable();
      return;
    }
    if (reply.status === 404) {
      this.available = false;
      this.stop();
      this.kernels = new Map();
      this.emit(new Map());
      return;
    }
    if (reply.status !== 200) {
      return;
    }
    const list = (await reply.json()) as ElasticKernel[];
    const previous = this.kernels;
    this.kernels = new Map(list.map(kernel => [kernel.id, kernel]));
    this.available = true;
    this.reachable = true;
    this.lastAnswer = Date.now();
    this.emit(previous);
  }

  private unreachable(): void {
    if (this.reachable && this.available) {
      this.reachable = false;
      this.emit(this.kernels);
    }
  }

  /** Poll now (after an action, or a cell sent to a hibernated kernel), then on schedule. */
  async refresh(): Promise<void> {
    const scheduled = this.timer !== null;
    this.stop();
    await this.poll();
    if (scheduled && this.available !== false && this.timer === null) {
      this.timer = setTimeout(this.tick, this.nextDelay());
    }
  }

  private tick = async (): Promise<void> => {
    this.timer = null;
    await this.poll();
    if (this.available !== false && this.timer === null) {
      this.timer = setTimeout(this.tick, this.nextDelay());
    }
  };

  start(): void {
    void this.tick();
  }

  stop(): void {
    if (this.timer !== null) {
      clearTimeout(this.timer);
      this.timer = null;
    }
  }

  private emit(previous: Map<string, ElasticKernel>): void {
    for (const listener of this.listeners) {
      listener(this, previous);
    }
  }
}

/** A GPU size as `GET /api/elastic/profiles` lists it. */
export interface Profile {
  name: string;
  display_name: string;
  gpu_fraction: number;
  memory_mib: number | null;
  kernelspecs?: string[];
  /** A slice of this size is free now (else a new kernel of it waits its turn in the queue). */
  fits_now?: boolean;
  /** Some GPU here is big enough for it at all. */
  fits_ever?: boolean;
}

/** What a launcher card (or the kernel picker) says of a size that would not start at once:
 * `startsWait` when the server lets a new kernel wait for a slice (`start_queue_wait`), else such
 * a start is refused. */
export function fitNote(profile: Profile, startsWait = false): string {
  if (profile.fits_ever === false) {
    return 'never fits these GPUs';
  }
  if (profile.fits_now !== false) {
    return '';
  }
  return startsWait ? 'all taken: waits for a slice' : 'all taken now';
}

/**
 * JupyterLab's "Select Kernel" dialog, which it also opens after a start was refused: a note for
 * each GPU-size kernelspec that would not start at once, and, when the one preselected does not
 * fit now and would be refused again, the kernelspec to preselect instead: of the same kernel's
 * sizes that fit now, the largest not larger than it (`null`: leave the choice alone).
 */
export function pickerChoice(
  specs: string[],
  selected: string | null,
  profiles: Profile[],
  startsWait: boolean
): { notes: Record<string, string>; select: string | null } {
  const profileOf = new Map<string, Profile>();
  for (const profile of profiles) {
    for (const spec of profile.kernelspecs ?? []) {
      profileOf.set(spec, profile);
    }
  }
  const notes: Record<string, string> = {};
  for (const spec of specs) {
    const profile = profileOf.get(spec);
    const note = profile ? fitNote(profile, startsWait) : '';
    if (note) {
      notes[spec] = note;
    }
  }
  const current = selected ? profileOf.get(selected) : undefined;
  if (!selected || !current || current.fits_now !== false || startsWait) {
    return { notes, select: null };
  }
  // "python3-gpu-whole" and "python3-gpu-small" are one kernel's sizes; "ir-gpu-small" is not.
  const base = (spec: string, profile: Profile): string =>
    spec.endsWith(profile.name) ? spec.slice(0, spec.length - profile.name.length) : spec;
  const fitting = specs
    .filter(spec => {
      const profile = profileOf.get(spec);
      return (
        profile?.fits_now === true &&
        profile.gpu_fraction <= current.gpu_fraction &&
        base(spec, profile) === base(selected, current)
      );
    })
    .sort((a, b) => (profileOf.get(b)?.gpu_fraction ?? 0) - (profileOf.get(a)?.gpu_fraction ?? 0));
  return { notes, select: fitting[0] ?? null };
}

/** A launcher icon for a GPU size: the share of the GPU as a filled pie, the memory under it. */
export function sizeIconSvg(fraction: number, memoryMib: number | null): string {
  const share = Math.max(0, Math.min(1, fraction));
  const r = 17;
  const [cx, cy] = [26, 22];
  let pie: string;
  if (share >= 0.999) {
    pie = `<circle cx="${cx}" cy="${cy}" r="${r}" fill="#f57c00"/>`;
  } else {
    const angle = 2 * Math.PI * share;
    const x = cx + r * Math.sin(angle);
    const y = cy - r * Math.cos(angle);
    const large = share > 0.5 ? 1 : 0;
    pie = `<path d="M${cx} ${cy} L${cx} ${cy - r} A${r} ${r} 0 ${large} 1 ${x.toFixed(2)} ${y.toFixed(2)} Z" fill="#f57c00"/>`;
  }
  const memory = memoryMib ? formatMib(memoryMib).replace('.0 ', ' ') : '';
  return (
    '<svg xmlns="http://www.w3.org/2000/svg" width="52" height="52" viewBox="0 0 52 52">' +
    `<circle cx="${cx}" cy="${cy}" r="${r}" fill="#e0e0e0" stroke="#9e9e9e" stroke-width="1"/>` +
    pie +
    (memory
      ? `<text x="26" y="50" text-anchor="middle" font-family="sans-serif" font-size="10" fill="#616161">${memory}</text>`
      : '') +
    '</svg>'
  );
}

/** "Python 3 · GPU small (10 GiB)" -> "Python 3 · GPU small": the card's icon shows the memory. */
export function shortLabel(displayName: string): string {
  return displayName.replace(/\s*\([^)]*\)\s*$/, '') || displayName;
}

function cssString(text: string): string {
  return `"${text.replace(/\\/g, '\\\\').replace(/"/g, '\\"').replace(/\n/g, '\\a ')}"`;
}

/**
 * The launcher's cards of GPU-size kernelspecs, ordered by size (smallest first, after the
 * kernels without a size), each with its size's icon and a short label, as a style sheet: the
 * launcher sorts by name and draws the kernel's own logo, and offers no other hook. The cards
 * keep their full name as their title (tooltip) and the icon's alt text.
 */
export function launcherCss(
  profiles: Profile[],
  displayNameOf: (spec: string) => string | undefined,
  startsWait = false
): string {
  const sized = [...profiles].sort(
    (a, b) => a.gpu_fraction - b.gpu_fraction || (a.memory_mib ?? 0) - (b.memory_mib ?? 0) || a.name.localeCompare(b.name)
  );
  const rules: string[] = [];
  sized.forEach((profile, index) => {
    const icon = `url("data:image/svg+xml,${encodeURIComponent(sizeIconSvg(profile.gpu_fraction, profile.memory_mib))}")`;
    for (const spec of profile.kernelspecs ?? []) {
      const title = displayNameOf(spec);
      if (!title) {
        continue;
      }
      const card = `.jp-LauncherCard[title=${cssString(title)}]`;
      const note = fitNote(profile, startsWait);
      const label = note ? `${shortLabel(title)}\n${note}` : shortLabel(title);
      rules.push(
        `${card} { order: ${index + 1};${note ? ' opacity: 0.6;' : ''} }`,
        `${card} .jp-LauncherCard-icon img { content: ${icon}; }`,
        `${card} .jp-LauncherCard-label p { font-size: 0; }`,
        `${card} .jp-LauncherCard-label p::after { content: ${cssString(label)}; display: block; white-space: pre-line; font-size: var(--jp-ui-font-size1); line-height: 1.2; }`
      );
    }
  });
  return rules.join('\n');
}

/** The sizes a kernel of size `current` can change to, as the change-size dialog lists them. */
export function sizeChoices(profiles: (Profile & { fits_now?: boolean; fits_ever?: boolean })[], current: string | null): { name: string; label: string }[] {
  return [...profiles]
    .filter(p => p.name !== current && p.fits_ever !== false)
    .sort((a, b) => a.gpu_fraction - b.gpu_fraction || (a.memory_mib ?? 0) - (b.memory_mib ?? 0))
    .map(p => {
      const share = p.gpu_fraction >= 1 ? `${p.gpu_fraction} GPU` : `${Math.round(p.gpu_fraction * 100)}% of a GPU`;
      const memory = p.memory_mib ? `, ${formatMib(p.memory_mib)}` : '';
      const when = p.fits_now === false ? ' · waits for a free slice' : '';
      return { name: p.name, label: `${p.name} (${share}${memory})${when}` };
    });
}

/**
 * The kernelspec name a notebook's connection to `kernel` should carry when it is not
 * `connectionName`, else ''. A size change keeps the kernel's id and gives it the new size's
 * kernelspec; JupyterLab's connection keeps the name it was opened with (and its toolbar the old
 * size). Only once the kernel has settled (running or hibernated), never half-way through a change.
 */
export function renamedKernel(connectionName: string, kernel: ElasticKernel | undefined): string {
  if (!kernel?.profile || !kernel.name || kernel.name === connectionName) {
    return '';
  }
  return ['running', 'hibernated'].includes(kernel.state) ? kernel.name : '';
}

/** The notification while a kernel's resume waits for a GPU slice ('' when it does not wait). */
export function waitingText(kernel: ElasticKernel | undefined, where: string | undefined): string {
  if (kernel?.resume?.phase !== 'waiting_for_slice') {
    return '';
  }
  const size = kernel.profile ? ` (${kernel.profile})` : '';
  return `${where ? where + ': ' : ''}waiting for a free GPU slice${size} to resume the kernel${queuePlace(kernel.resume)}. Cancel keeps it hibernated, with its variables.`;
}
