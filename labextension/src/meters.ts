/**
 * The GPUs panel's meters: a short history of each GPU's use kept in the browser (one sample
 * per poll, no history endpoint: the panel only shows the last couple of minutes), drawn as
 * sparklines. No JupyterLab imports, so vitest runs it as plain TypeScript.
 */
import { formatGpuHours, formatMib } from './model';

/** The last `size` samples per key (a GPU's uuid, or "released"); null is a gap (not measured). */
export class History {
  private series = new Map<string, (number | null)[]>();

  constructor(public size = 40) {}

  push(key: string, value: number | null): void {
    const values = this.series.get(key) ?? [];
    values.push(value);
    if (values.length > this.size) {
      values.splice(0, values.length - this.size);
    }
    this.series.set(key, values);
  }

  get(key: string): (number | null)[] {
    return [...(this.series.get(key) ?? [])];
  }
}

/**
 * An SVG path through `values` scaled to 0..`max` in a `width` x `height` box, newest at the
 * right edge, a gap where a value is null. '' when nothing was measured.
 */
export function sparklinePath(values: (number | null)[], max: number, width: number, height: number, slots = values.length): string {
  const step = slots > 1 ? width / (slots - 1) : 0;
  const offset = (slots - values.length) * step;
  const scale = max > 0 ? max : 1;
  let path = '';
  let pen = false;
  values.forEach((value, index) => {
    if (value === null || !Number.isFinite(value)) {
      pen = false;
      return;
    }
    const x = offset + index * step;
    const y = height - (Math.max(0, Math.min(scale, value)) / scale) * height;
    path += `${pen ? 'L' : 'M'}${x.toFixed(1)} ${y.toFixed(1)} `;
    pen = true;
  });
  return path.trim();
}

/** A sparkline as an SVG string (the panel sets it as innerHTML of a fixed-size box). */
export function sparklineSvg(values: (number | null)[], max: number, slots: number, width = 80, height = 18): string {
  const path = sparklinePath(values, max, width, height - 2, slots);
  return (
    `<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}" viewBox="0 -1 ${width} ${height}">` +
    (path ? `<path d="${path}" fill="none" stroke="currentColor" stroke-width="1.5"/>` : '') +
    '</svg>'
  );
}

/** A device as `GET /api/elastic/gpus` lists it (with its live use). */
export interface DeviceModel {
  uuid: string;
  name: string;
  /** Its index on its machine (what nvidia-smi shows), and the node it is on (Kubernetes). */
  index?: number;
  node?: string;
  memory_mib?: number;
  used_fraction?: number;
  slices?: { kernel_id: string; profile?: string; fraction?: number; memory_mib?: number; warm?: boolean }[];
  other_users?: { slices: number; fraction: number; memory_mib: number };
  activity?: { gpu_utilization: number | null; memory_used_mib: number | null };
}

export interface Meter {
  /** 0..1 of the bar; null: not measured. */
  fraction: number | null;
  text: string;
}

/** The utilisation meter: "GPU 35%", or "GPU: not measured". */
export function utilizationMeter(device: DeviceModel): Meter {
  const util = device.activity?.gpu_utilization;
  if (util === null || util === undefined) {
    return { fraction: null, text: 'GPU use: not measured' };
  }
  return { fraction: Math.max(0, Math.min(1, util / 100)), text: `GPU use ${Math.round(util)}%` };
}

/** The memory meter: "Memory 2.0 of 40.0 GiB", or "Memory: not measured". */
export function memoryMeter(device: DeviceModel): Meter {
  const used = device.activity?.memory_used_mib;
  if (used === null || used === undefined) {
    return { fraction: null, text: 'Memory: not measured' };
  }
  const total = device.memory_mib ?? 0;
  const fraction = total > 0 ? Math.max(0, Math.min(1, used / total)) : null;
  return { fraction, text: `Memory ${formatMib(used)}${total ? ` of ${formatMib(total)}` : ''}` };
}

/**
 * GPU time released, readably, with its trend: the total, and the share of a GPU that is free
 * right now because its kernels sleep ("0.25 GPU released now"), which is the rate it grows at.
 */
export function releasedText(totalHours: number, gpusNow: number | null | undefined): string {
  let text = `GPU time released by hibernation: ${formatGpuHours(totalHours)}`;
  if (gpusNow !== null && gpusNow !== undefined) {
    text +=
      gpusNow > 0
        ? ` · ${parseFloat(gpusNow.toFixed(2))} GPU released now (+${formatGpuHours(gpusNow)} per hour)`
        : ' · none released now';
  }
  return text;
}

/** A GPU as the panel names it: "GPU 1 · NVIDIA H100 80GB HBM3" (with its node on Kubernetes), so
 * that identical models are told apart. */
export function deviceLabel(device: DeviceModel): string {
  const where = device.node ? ` on ${device.node}` : '';
  return device.index === undefined || device.index === null
    ? `${device.name}${where}`
    : `GPU ${device.index}${where} · ${device.name}`;
}
